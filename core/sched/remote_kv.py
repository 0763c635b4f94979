"""KV that arrives from, or leaves for, another engine (disaggregated
prefill/decode), as the scheduler handles it through a KVConnector
(core/kv/connector.py). A base of Scheduler (core/sched/scheduler.py).

Decode side: a request whose prompt KV comes from a peer is admitted with
blocks for its whole prompt and parks in ``waiting_for_kv``
(WAITING_FOR_REMOTE_KVS): it holds no token budget and no ``max_num_seqs``
slot, and no worker hears of it. Once the connector reports its KV received
(with the first token the prefill sampled), the token goes through the stop
rules and the grammar like a sampled one and out to the client at once; the
request then goes back to the front of the queue with its prompt computed and
runs its first decode step as a new request that already has that token.

Prefill side: a finished request whose blocks a send still reads stays in
``held_for_kv`` (blocks allocated, request gone) until the connector lists it
as freeable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenbudget.core.failures import RequestFailure
from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.request import Request, RequestStatus
from tokenbudget.core.stop import check_stop

if TYPE_CHECKING:
    from tokenbudget.core.config import SchedulerConfig
    from tokenbudget.core.kv.connector import KVConnector
    from tokenbudget.core.outputs import ModelRunnerOutput, SchedulerOutput
    from tokenbudget.core.sched.step import Step


class RemoteKV:
    """The scheduler's side of a KV connector; without one (``kv_connector``
    None) every hook here is a no-op."""

    scheduler_config: SchedulerConfig
    kv_cache_manager: Any
    structured_output_manager: Any
    requests: dict[str, Request]
    waiting: Any
    _side_outputs: list[RequestOutput]

    def _init_remote_kv(self, kv_connector: KVConnector | None) -> None:
        self.kv_connector = kv_connector
        # Admitted, blocks allocated, waiting for their prompt's KV from a peer.
        self.waiting_for_kv: dict[str, Request] = {}
        # Their KV arrived: back in ``waiting``, prompt computed, not yet running.
        self._kv_received: set[str] = set()
        # Finished, blocks kept while the connector needs them (id -> request).
        self.held_for_kv: dict[str, Request] = {}

    def has_pending_transfers(self) -> bool:
        """Whether KV transfers or blocks held for them are outstanding: the
        engine keeps stepping (and polling its workers) until they are done."""
        c = self.kv_connector
        return c is not None and bool(self.held_for_kv or self.waiting_for_kv or c.has_pending())

    # -- admission ---------------------------------------------------------------
    def _wants_remote_kv(self, req: Request, num_cached: int) -> bool:
        """Whether ``req``'s prompt KV past its ``num_cached`` local hits comes
        from a peer. Asked only before its first token: a request that has
        one got its KV already (preempted since, it recomputes)."""
        c = self.kv_connector
        return (
            c is not None and not req.output_token_ids and c.num_remote_tokens(req, num_cached) > 0
        )

    def _admit_for_remote_kv(self, req: Request, hits: list, num_cached: int, policy) -> bool:
        """Allocate blocks for ``req``'s whole prompt (all or nothing, its
        ``hits`` kept) and park it until its KV arrives; False when memory is
        short (it waits at the head of the queue like any request)."""
        kv = self.kv_cache_manager
        num_remote = req.num_tokens - num_cached
        if not policy.admits(req, num_remote, hits, num_cached):
            return False
        # As lookahead slots: no block is findable by its hash (a prefix hit
        # for others) before its KV is written.
        if kv.allocate_slots(req, 0, hits, num_cached, num_remote) is None:
            return False
        self.waiting.pop()
        kv.record_prefix_lookup(req, num_cached)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        rid = req.request_id
        self.waiting_for_kv[rid] = req
        self.kv_connector.on_allocated(req, kv.get_block_ids(rid), num_cached)
        return True

    def _kv_arrived(self, req: Request) -> bool:
        return req.request_id in self._kv_received

    def _admit_received(self, req: Request, step: Step, policy) -> bool:
        """Admit a request whose prompt KV arrived: it holds its prompt's
        blocks and computes its one token (no prefix lookup: its blocks are
        its own). False when the block for that token is not free."""
        num_new = req.num_tokens - req.num_computed_tokens
        lookahead = self.scheduler_config.num_speculative_tokens
        if self.kv_cache_manager.allocate_slots(req, num_new, None, 0, lookahead) is None:
            return False
        self._kv_received.discard(req.request_id)
        policy.on_admitted(req)
        self.waiting.pop()
        self._start_running(req, step, req.num_computed_tokens, num_new)
        return True

    # -- the connector's news, at the start of each step ------------------------------
    def _take_connector_events(self) -> None:
        c = self.kv_connector
        if c is None:
            return
        events = c.take_events()
        for rid, token in events.received.items():
            req = self.waiting_for_kv.pop(rid, None)
            if req is not None:  # else aborted meanwhile
                self._on_kv_received(req, token)
        for rid, reason in events.failed.items():
            if rid in self.waiting_for_kv:
                failure = RequestFailure(
                    f"request {rid!r}: its prompt's KV did not arrive from the prefill "
                    f"engine: {reason}"
                )
                self._fail_requests({rid: failure})
        for rid in events.freeable:
            req = self.held_for_kv.pop(rid, None)
            if req is not None:
                self.kv_cache_manager.free(req)

    def _on_kv_received(self, req: Request, token: int) -> None:
        """``req``'s prompt KV is in its blocks and ``token`` is its first
        output token: output it now; then the request ends (a stop) or runs
        next (front of the queue)."""
        rid = req.request_id
        kv = self.kv_cache_manager
        req.num_computed_tokens = req.num_tokens
        kv.allocate_slots(req, 0)  # registers its full prompt blocks in the prefix cache
        req.status = RequestStatus.WAITING
        status, kept = check_stop(req, [token], self.scheduler_config.max_model_len)
        if self.structured_output_manager is not None and req.structured_request is not None:
            status = self._accept_structured(req, kept, status)
            if rid not in self.requests:
                return  # its grammar refused the token: failed (its output is queued)
        reason = None if status is None else RequestStatus.finish_reason(status)
        self._side_outputs.append(
            RequestOutput(rid, kept, reason, None, req.num_cached_tokens, req.stop_reason)
        )
        if status is not None:
            self._free_request(req, status)
        else:
            self._kv_received.add(rid)
            self.waiting.prepend(req)

    # -- the end of a request, and the workers' reports ------------------------------
    def _release_blocks(self, req: Request) -> None:
        """Free a finished request's blocks, unless the connector still needs
        them (a send reads them, or a peer may still write into them)."""
        c = self.kv_connector
        kv = self.kv_cache_manager
        if c is not None:
            rid = req.request_id
            self.waiting_for_kv.pop(rid, None)
            self._kv_received.discard(rid)
            if c.request_finished(req, kv.get_block_ids(rid)):
                self.held_for_kv[rid] = req
                return
        kv.free(req)

    def _abort_held(self, request_ids) -> None:
        """Aborts of requests that already finished but whose blocks a KV
        send still holds: the connector stops waiting (or sending) for them."""
        c = self.kv_connector
        if c is not None and self.held_for_kv:
            for rid in request_ids:
                if rid in self.held_for_kv:
                    c.abort_finished(rid)

    def _report_sends(self, mro: ModelRunnerOutput) -> None:
        c = self.kv_connector
        if c is not None and (mro.finished_sending or mro.failed_sending):
            c.on_worker_output(mro.finished_sending or set(), mro.failed_sending or {})

    def _add_connector_metadata(self, out: SchedulerOutput) -> None:
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_metadata()
