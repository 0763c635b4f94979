"""Requests in and out of the scheduler: arrival (add_request, with the
checks of intake.py and room made in a full queue) and the ways a request
ends (finish_requests, and the outputs of those finished outside a model
step, handed out by take_side_outputs). A base of Scheduler
(core/sched/scheduler.py), which owns the state annotated below."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenbudget.core.failures import (
    DuplicateRequestError,
    QueueFullError,
    RequestFailure,
    error_of,
)
from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.request import Request, RequestStatus
from tokenbudget.core.sched.intake import check_request

if TYPE_CHECKING:
    from tokenbudget.core.config import CacheConfig, SchedulerConfig
    from tokenbudget.core.kv.tiering import KVTiering
    from tokenbudget.core.sched.encoder_cache import EncoderCacheManager


class RequestLifecycle:
    """add_request, finish_requests and the ways a request ends, a base of
    Scheduler."""

    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    kv_tiering: KVTiering
    kv_cache_manager: Any
    encoder_cache_manager: EncoderCacheManager
    structured_output_manager: Any
    lora_gate: Any  # core/sched/lora_gate.py, None without LoRA
    requests: dict[str, Request]
    waiting: Any
    running: list[Request]
    finished_req_ids: set[str]
    _side_outputs: list[RequestOutput]
    _pool_tokens: int
    held_for_kv: dict[str, Request]  # core/sched/remote_kv.py

    def add_request(self, request: Request) -> None:
        cfg = self.scheduler_config
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} already exists")
        if request.request_id in self.held_for_kv:
            raise DuplicateRequestError(
                f"request_id {request.request_id!r} is still in use: its KV is being sent"
            )
        check_request(
            request,
            cfg,
            self._pool_tokens,
            self.structured_output_manager is not None,
            self.lora_gate is not None,
        )
        # Last check that can refuse: nothing may be registered before it.
        if cfg.max_queued_requests and len(self.waiting) >= cfg.max_queued_requests:
            self._make_room_in_queue(request)
        if request.sampling_params.structured is not None:
            self.structured_output_manager.add_request(request)
            request.status = RequestStatus.WAITING_FOR_FSM
        if self.cache_config.enable_prefix_caching:
            # Hash the prompt's full blocks once, on arrival, off the step path.
            self.kv_cache_manager.hasher.update(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _make_room_in_queue(self, request: Request) -> None:
        limit = self.scheduler_config.max_queued_requests
        # A priority queue lets a strictly better newcomer take the worst one's place.
        worst = self.waiting.evictable_for(request)
        if worst is None:
            raise QueueFullError(
                f"the waiting queue is full (max_queued_requests={limit}); retry later"
            )
        reason = (
            f"evicted from the full waiting queue (max_queued_requests={limit}) by a "
            "higher-priority request; retry later"
        )
        # As an error, so its client gets the status it would have had on arrival.
        self._finish_with_output(
            worst, RequestStatus.FINISHED_ABORTED, reason, QueueFullError(reason)
        )

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> list[str]:
        """Finish (abort) requests at once, freeing their blocks. Unknown or
        already finished ids are skipped; returns the ids that were finished."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        assert RequestStatus.is_finished(finished_status)
        if finished_status == RequestStatus.FINISHED_ABORTED:
            self._abort_held(request_ids)  # finished, blocks held for a KV send
        done: list[Request] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                done.append(req)
        if not done:
            return []
        running = [r for r in done if r.status == RequestStatus.RUNNING]
        if running:
            gone = {id(r) for r in running}
            self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.remove_requests([r for r in done if r.status != RequestStatus.RUNNING])
        for req in done:
            self._free_request(req, finished_status)
        return [r.request_id for r in done]

    def _free_request(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._release_blocks(req)  # kept while a KV transfer needs them (remote_kv.py)
        self.kv_tiering.on_free(req)
        if req.mm_features:
            self.encoder_cache_manager.free(req)
        if req.structured_request is not None and self.structured_output_manager is not None:
            self.structured_output_manager.remove_request(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def take_side_outputs(self) -> list[RequestOutput]:
        """Outputs that arose outside a model step (queue evictions)."""
        outputs, self._side_outputs = self._side_outputs, []
        return outputs

    def _finish_with_output(
        self, req: Request, status: RequestStatus, reason: str, error: Exception | None = None
    ) -> None:
        """Finish ``req`` outside a model step; its reader gets the output
        (``reason``, and ``error`` to raise) from the next update_from_output."""
        self.finish_requests([req.request_id], status)
        req.stop_reason = reason
        self._side_outputs.append(
            RequestOutput(
                req.request_id,
                [],
                RequestStatus.finish_reason(status),
                None,
                max(req.num_cached_tokens, 0),
                reason,
                error,
            )
        )

    def _fail_requests(self, failed: dict[str, RequestFailure]) -> None:
        """Finish requests that failed in the engine, each with its error (an
        output for its reader); the others are not touched."""
        for rid, failure in failed.items():
            req = self.requests.get(rid)
            if req is None:
                continue  # finished since it was scheduled
            self._finish_with_output(
                req, RequestStatus.FINISHED_ERROR, failure.message, error_of(failure)
            )

    def _fail_outgrown(self, req: Request) -> None:
        need = req.num_tokens + self.scheduler_config.num_speculative_tokens
        self._fail_requests(
            {
                req.request_id: RequestFailure(
                    f"request {req.request_id!r} needs {need} tokens of KV cache to go on, and the "
                    f"whole KV cache holds {self._pool_tokens} tokens; lower max_tokens (or "
                    "max_model_len), or give the cache more blocks",
                    invalid_argument=True,
                )
            }
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
