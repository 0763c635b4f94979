"""The phase-free token-budget scheduler.

There is no prefill or decode phase. Every request has ``num_computed_tokens``
and a target, ``num_tokens_with_spec`` (prompt + outputs + draft tokens); each
step hands out at most ``max_num_batched_tokens`` tokens so requests catch up:
running requests first, in order, then waiting ones in queue order.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.sched.encoder_cache import EncoderCacheManager
from tokenbudget.core.failures import (RequestFailure, UnsupportedRequestError,
                                       WorkerReplyError, describe, error_of)
from tokenbudget.core.kv import KVCacheManager
from tokenbudget.core.kv.tiering import KVTiering
from tokenbudget.core.policy.cache_aware import (REORDERING_POLICIES, AdmissionReserve, WaitingOrder,
                                     make_victim_picker)
from tokenbudget.core.outputs import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                      PromptLogprobs, RequestOutput, SchedulerOutput)
from tokenbudget.core.policy.queues import create_queue
from tokenbudget.core.request import Request, RequestStatus
from tokenbudget.core.policy.slo import FairShare, SLOOrder
from tokenbudget.core.sched.stats import SpecDecodingStats
from tokenbudget.core.stop import check_stop


class DuplicateRequestError(ValueError):
    """A request id that is already in the scheduler."""


class QueueFullError(ValueError):
    """The waiting queue is at max_queued_requests."""


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    encoder_cache_usage: float
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    # The host KV tier (core/kv/tiering.py); zeros without one.
    num_offload_blocks: int = 0
    offload_blocks_used: int = 0
    num_swapped_requests: int = 0
    # Tokens computed again after a preemption had thrown their KV away.
    num_recomputed_tokens: int = 0
    kv_swap_out_blocks: int = 0
    kv_swap_in_blocks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(slots=True)
class _Step:
    """What one schedule() call has handed out so far."""

    token_budget: int
    encoder_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    resumed: set[str] = field(default_factory=set)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # Preempted by a higher-priority waiting request (admission still runs).
    displaced: list[Request] = field(default_factory=list)
    # Fair share: prompt tokens each tenant may still get this step (or None).
    tenant_caps: dict[str | None, int] | None = None


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 structured_output_manager=None, *, defer_grammar_bitmask: bool = False) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set before building a Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size,
            cache_config.enable_prefix_caching, cache_config.hash_algo, cache_config.hash_seed)
        self.kv_tiering = KVTiering(self.kv_cache_manager, cache_config)
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_size)
        self.structured_output_manager = structured_output_manager
        # Schedule with a pending grammar_bitmask (a Future) that the engine
        # resolves via fill_grammar_bitmask once the previous step's tokens are in.
        self.defer_grammar_bitmask = defer_grammar_bitmask
        self.requests: dict[str, Request] = {}
        self.waiting = create_queue(scheduler_config.policy, scheduler_config.priority_descending)
        self.running: list[Request] = []
        # Sent to workers in the next SchedulerOutput so they drop their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_decoding_stats = SpecDecodingStats()
        # Drafts the last update dropped because a step in flight made them stale.
        self.num_stale_drafts = 0
        self._pick_victim_from = make_victim_picker(scheduler_config)
        block_size = cache_config.block_size
        self._order = (WaitingOrder(scheduler_config, block_size)
                       if scheduler_config.policy in REORDERING_POLICIES else None)
        self._reserve = (AdmissionReserve(scheduler_config, block_size)
                         if scheduler_config.use_admission_reserve else None)
        self._priority_sign = -1 if scheduler_config.priority_descending else 1
        self._slo = SLOOrder(scheduler_config) if scheduler_config.policy == "slo" else None
        self._fair = FairShare(scheduler_config) if scheduler_config.fair_share else None
        # Outputs produced outside a model step (queue evictions), returned by
        # the next update_from_output.
        self._side_outputs: list[RequestOutput] = []
        self.clock = time.monotonic
        # Tokens the whole KV cache holds: a request needing more can never run.
        self._pool_tokens = (cache_config.num_blocks - 1) * cache_config.block_size

    # -- requests in and out ------------------------------------------------
    def add_request(self, request: Request) -> None:
        cfg = self.scheduler_config
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} already exists")
        if request.num_tokens > cfg.max_model_len:
            raise ValueError(f"prompt has {request.num_tokens} tokens, more than "
                             f"max_model_len={cfg.max_model_len}")
        pool_tokens = self._pool_tokens
        if request.num_tokens + cfg.num_speculative_tokens > pool_tokens:
            # It could never be admitted and would block the queue behind it.
            raise ValueError(f"prompt has {request.num_tokens} tokens but the KV cache holds "
                             f"only {pool_tokens}; raise num_gpu_blocks or shorten the prompt")
        limit = min(cfg.encoder_cache_size, cfg.encoder_compute_budget)
        for f in request.mm_features:
            if f.length > limit:
                raise ValueError(
                    f"multimodal item {f.mm_hash} needs {f.length} encoder embeddings, more than "
                    f"the encoder cache/budget allows ({limit}); use a smaller image or raise "
                    "encoder_cache_size")
            if f.offset + f.length > request.num_prompt_tokens:
                raise ValueError(f"multimodal item {f.mm_hash} placeholder "
                                 f"[{f.offset}, {f.offset + f.length}) lies outside the prompt")
        if request.sampling_params.structured is not None and \
                self.structured_output_manager is None:
            raise ValueError("structured output is not enabled on this engine")
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
        if self.scheduler_config.policy == "priority":
            worst = self.waiting.worst()
            sign = self._priority_sign
            if sign * request.priority < sign * worst.priority:  # strictly better
                self.finish_requests([worst.request_id], RequestStatus.FINISHED_ABORTED)
                worst.stop_reason = (f"evicted from the full waiting queue (max_queued_requests="
                                     f"{limit}) by a higher-priority request; retry later")
                # As an error, so its client gets the status it would have had on arrival.
                self._side_outputs.append(RequestOutput(
                    worst.request_id, [], "abort", None, max(worst.num_cached_tokens, 0),
                    worst.stop_reason, QueueFullError(worst.stop_reason)))
                return
        raise QueueFullError(f"the waiting queue is full (max_queued_requests={limit}); "
                             "retry later")

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> list[str]:
        """Finish (abort) requests at once, freeing their blocks. Unknown or
        already finished ids are skipped; returns the ids that were finished."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        assert RequestStatus.is_finished(finished_status)
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
        self.kv_cache_manager.free(req)
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

    def _fail_requests(self, failed: dict[str, RequestFailure]) -> None:
        """Finish requests that failed in the engine, each with its error (an
        output for its reader); the others are not touched."""
        for rid, failure in failed.items():
            req = self.requests.get(rid)
            if req is None:
                continue  # finished since it was scheduled
            self.finish_requests([rid], RequestStatus.FINISHED_ERROR)
            req.stop_reason = failure.message
            self._side_outputs.append(RequestOutput(
                rid, [], "error", None, max(req.num_cached_tokens, 0), failure.message,
                error_of(failure)))

    def _fail_outgrown(self, req: Request) -> None:
        need = req.num_tokens + self.scheduler_config.num_speculative_tokens
        self._fail_requests({req.request_id: RequestFailure(
            f"request {req.request_id!r} needs {need} tokens of KV cache to go on, and the "
            f"whole KV cache holds {self._pool_tokens} tokens; lower max_tokens (or "
            "max_model_len), or give the cache more blocks", invalid_argument=True)})

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_tiering.reset()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        t = self.kv_tiering
        return SchedulerStats(len(self.running), len(self.waiting), kv.usage(),
                              kv.prefix_queries, kv.prefix_hits, self.num_preemptions,
                              self.encoder_cache_manager.usage(),
                              self.spec_decoding_stats.copy(),
                              t.host.num_slots if t.host is not None else 0,
                              t.num_offload_blocks_used(), len(t.swapped),
                              t.num_recomputed_tokens, t.num_swapped_out_blocks,
                              t.num_swapped_in_blocks)

    # -- schedule -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.scheduler_config
        step = _Step(cfg.max_num_batched_tokens, cfg.encoder_compute_budget)
        if self._reserve is not None:
            self._reserve.on_step()
        if self._slo is not None:
            self._slo.on_schedule(self.clock(), bool(self.running))
        if self.structured_output_manager is not None:
            self._abort_failed_grammars()
        if cfg.policy == "priority" and cfg.priority_preemption_threshold >= 0 and self.waiting:
            self._preempt_for_priority(step)
        elif self._fair is not None and self.waiting:
            self._preempt_for_fair_share(step)
        if self._fair is not None and cfg.fair_share_chunk_cap:
            step.tenant_caps = self._fair.chunk_caps(self.running, self.waiting,
                                                     cfg.max_num_batched_tokens)
        self._schedule_running(step)
        # A step that had to preempt is out of memory: admitting now would
        # only preempt again next step.
        if not step.preempted:
            self._admit_waiting(step)
        elif self._reserve is not None:
            self._reserve.on_preemption(self.running)
        out = self._make_output(step)
        self.kv_tiering.finish_step(out)
        self._update_after_schedule(step, out)
        return out

    def _abort_failed_grammars(self) -> None:
        # A grammar that failed to compile (or timed out) ends its request with the error.
        for req, error in self.structured_output_manager.take_failed():
            self.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
            req.stop_reason = str(error)
            self._side_outputs.append(RequestOutput(req.request_id, [], "abort", None, 0,
                                                    req.stop_reason, error))

    def _schedule_running(self, step: _Step) -> None:
        # The hot loop of every step (once per running request): attributes
        # are read once into locals and the budget is kept in a local,
        # written back to ``step`` around the calls that read or change it.
        cfg = self.scheduler_config
        allocate = self.kv_cache_manager.allocate_slots
        threshold = cfg.long_prefill_token_threshold
        max_model_len = cfg.max_model_len
        lookahead = cfg.num_speculative_tokens
        running = self.running
        # policy slo: decodes, then prompt chunks by deadline slack (a copy).
        order = running if self._slo is None else self._slo.chunk_order(running, self.clock())
        num_scheduled = step.num_scheduled
        scheduled_reqs = step.cached_reqs
        new_block_ids = step.new_block_ids
        budget = step.token_budget
        caps = step.tenant_caps
        is_running = RequestStatus.RUNNING
        i = 0
        while i < len(order) and budget > 0:
            req = order[i]
            i += 1
            if req.status is not is_running:
                continue  # a victim preempted earlier this step (``order`` is a copy)
            placeholders = req.num_output_placeholders
            if placeholders and \
                    len(req.output_token_ids) + placeholders >= req.max_tokens:
                continue  # async: its last token is already being produced
            computed = req.num_computed_tokens
            num_new = (len(req.all_token_ids) + len(req.spec_token_ids) + placeholders
                       - computed)
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new > max_model_len - computed:
                num_new = max_model_len - computed
            # A prompt chunk (more than one known token to compute) counts
            # against its tenant's share; decodes are never held back.
            chunk = caps is not None and len(req.all_token_ids) - computed > 1
            if chunk and num_new > caps[req.tenant]:
                num_new = caps[req.tenant]
            encoder_inputs = None
            if req.mm_features:
                encoder_inputs, num_new = self._try_schedule_encoder_inputs(
                    req, computed, num_new, step)
            if num_new <= 0:
                continue
            new_ids = allocate(req, num_new, None, 0, lookahead)
            if new_ids is None:
                step.token_budget = budget
                while True:
                    victim = self._pick_victim()
                    if self._preempt(victim, step) < i and order is running:
                        i -= 1
                    if victim is req:
                        break
                    new_ids = allocate(req, num_new, None, 0, lookahead)
                    if new_ids is not None:
                        break
                # A victim scheduled earlier this step gave its tokens back.
                budget = step.token_budget
                if new_ids is None:
                    continue
            rid = req.request_id
            num_scheduled[rid] = num_new
            budget -= num_new
            if chunk:
                caps[req.tenant] -= num_new
            scheduled_reqs.append(req)
            new_block_ids[rid] = new_ids
            if req.spec_token_ids:
                num_spec = computed + num_new - len(req.all_token_ids)
                if num_spec > 0:
                    step.spec_tokens[rid] = req.spec_token_ids[:num_spec]
            if encoder_inputs:
                self._commit_encoder_inputs(req, encoder_inputs, step)
        step.token_budget = budget

    def _admit_waiting(self, step: _Step) -> None:
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        threshold = cfg.long_prefill_token_threshold
        waiting = self.waiting
        deprioritized = ()
        if step.token_budget > 0 and len(self.running) < cfg.max_num_seqs:
            if self._order is not None:
                deprioritized = self._order.reorder(waiting, kv, self.clock())
            if self._slo is not None:
                self._order_by_slo()
            if self._fair is not None:
                self._fair.order(waiting, self.running)
        reserve = self._reserve
        reserved = reserve.reserve_blocks(self.running) if reserve is not None else 0.0
        caps = step.tenant_caps
        skipped: list[Request] = []
        while waiting and step.token_budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = waiting.peek()
            if deprioritized and req.request_id in deprioritized or \
                    caps is not None and caps[req.tenant] <= 0:
                skipped.append(waiting.pop())
                continue
            if req.status == RequestStatus.WAITING_FOR_FSM:
                try:
                    ready = self.structured_output_manager.is_ready(req)
                except Exception as exc:  # its matcher cannot be built: it alone fails
                    self._fail_requests({req.request_id: describe(exc)})
                    continue
                if not ready:
                    # Keep its place in the queue, let the others go.
                    skipped.append(waiting.pop())
                    continue
                req.status = RequestStatus.WAITING
            if req.num_tokens + cfg.num_speculative_tokens > self._pool_tokens:
                self._fail_outgrown(req)  # else it would block the queue for ever
                continue
            hits, num_cached = kv.get_computed_blocks(req)
            # Past the device hits, the host tier may hold more (or its swapped KV).
            load = self.kv_tiering.plan_load(req, hits, num_cached)
            if load is None:
                break  # its swap-in waits for the next step's copy budget
            loads, num_cached = load
            num_new = req.num_tokens - num_cached
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > step.token_budget:
                num_new = step.token_budget
            if caps is not None and num_new > caps[req.tenant]:
                num_new = caps[req.tenant]
            encoder_inputs = None
            if req.mm_features:
                encoder_inputs, num_new = self._try_schedule_encoder_inputs(
                    req, num_cached, num_new, step)
            new_ids = None
            if num_new > 0 and self._fits_reserve(req, num_new, hits, num_cached, reserved):
                new_ids = kv.allocate_slots(req, num_new, hits, num_cached,
                                            cfg.num_speculative_tokens)
            if new_ids is None:
                self.kv_tiering.cancel_load(loads)
                if req.mm_features:
                    # Drop the encoder-cache references the lookup just took:
                    # a waiting request must not pin entries.
                    self.encoder_cache_manager.free(req)
                break
            if reserve is not None:
                reserved += reserve.future_tokens(req) / kv.block_size
            waiting.pop()
            self.kv_tiering.commit_load(req, hits, loads, num_cached)
            kv.record_prefix_lookup(req, num_cached)
            self.running.append(req)
            if req.status == RequestStatus.PREEMPTED:
                step.cached_reqs.append(req)
                step.resumed.add(req.request_id)
            else:
                step.new_reqs.append(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            step.num_scheduled[req.request_id] = num_new
            step.token_budget -= num_new
            if caps is not None:
                caps[req.tenant] -= num_new
            if encoder_inputs:
                self._commit_encoder_inputs(req, encoder_inputs, step)
        for req in reversed(skipped):
            waiting.prepend(req)

    def _order_by_slo(self) -> None:
        decoding = sum(1 for r in self.running if r.num_computed_tokens >= r.num_tokens)
        late = self._slo.reorder(self.waiting, self.clock(), decoding)
        for req in late:
            # Refused early: it could not meet its TTFT target anyway.
            self._free_request(req, RequestStatus.FINISHED_ABORTED)
            req.stop_reason = "cannot meet its TTFT target"
            self._side_outputs.append(RequestOutput(req.request_id, [], "abort", None,
                                                    max(req.num_cached_tokens, 0),
                                                    req.stop_reason))

    def _fits_reserve(self, req: Request, num_new: int, hits: list, num_cached: int,
                      reserved: float) -> bool:
        """With the admission reserve on: whether the running requests'
        expected growth, and this request's own, still fit after its blocks
        are taken."""
        reserve = self._reserve
        if reserve is None or not self.running:
            return True  # an idle engine admits whatever fits now, or nothing would run
        kv = self.kv_cache_manager
        own = reserve.future_tokens(req) / kv.block_size
        need = -(-(num_cached + num_new) // kv.block_size) - len(hits)
        return kv.block_pool.get_num_free_blocks() - need >= reserved + own

    # -- preemption -------------------------------------------------------------
    def _pick_victim(self) -> Request:
        if self._fair is not None:
            # Memory is short: the tenant furthest above its share gives back.
            seats = self._fair.seats(self.running, None, self.scheduler_config.max_num_seqs)
            worst = max((r.tenant for r in self.running), key=lambda t: seats[t])
            return next(r for r in reversed(self.running) if r.tenant == worst)
        return self._pick_victim_from(self.running)

    def _preempt_for_priority(self, step: _Step) -> None:
        """Let the best waiting request displace running requests whose
        priority is worse by more than the threshold (none is scheduled yet
        this step), only as many as it needs, and only if that suffices."""
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        sign = self._priority_sign
        head = self.waiting.peek()
        if head.status != RequestStatus.WAITING:
            return
        need_blocks, free, need_seq = self._head_needs(head)
        if free >= need_blocks and not need_seq:
            return
        bar = sign * head.priority + cfg.priority_preemption_threshold
        candidates = sorted((r for r in self.running if sign * r.priority > bar),
                            key=lambda r: (sign * r.priority, r.arrival_time), reverse=True)
        victims: list[Request] = []
        for r in candidates:
            if free >= need_blocks and not (need_seq and not victims):
                break
            victims.append(r)
            # Only blocks no one else references come back.
            free += sum(1 for b in kv.req_to_blocks.get(r.request_id, ()) if b.ref_cnt == 1)
        if free < need_blocks or (need_seq and not victims):
            return
        self._displace(victims, step)

    def _displace(self, victims: list[Request], step: _Step) -> None:
        """Preempt ``victims`` for a waiting request. Displacing (for priority
        or a fair share) is not a memory shortage: admission goes ahead."""
        for r in victims:
            self._preempt(r, step)
        step.displaced.extend(victims)
        for r in victims:
            step.preempted.remove(r)

    def _head_needs(self, head: Request) -> tuple[int, int, bool]:
        """What admitting ``head``'s first chunk takes: (blocks it needs,
        blocks free now, whether every seat is taken)."""
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        hits, num_cached = kv.get_computed_blocks(head)
        chunk = min(head.num_tokens - num_cached, cfg.max_num_batched_tokens)
        if 0 < cfg.long_prefill_token_threshold < chunk:
            chunk = cfg.long_prefill_token_threshold
        need_blocks = -(-(num_cached + chunk) // kv.block_size) - len(hits)
        # Hit blocks sitting in the free queue stop being free once touched.
        need_blocks += sum(1 for b in hits if b.ref_cnt == 0)
        return (need_blocks, kv.block_pool.get_num_free_blocks(),
                len(self.running) >= cfg.max_num_seqs)

    def _preempt_for_fair_share(self, step: _Step) -> None:
        """A tenant below its share of the running seats whose next request
        cannot get a seat or its first chunk's blocks takes them from the
        tenant furthest above its share (that tenant's latest admitted
        requests; their blocks stay in the prefix cache for their return)."""
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        self._fair.order(self.waiting, self.running)
        head = self.waiting.peek()
        if head.status != RequestStatus.WAITING:
            return
        need_blocks, free, need_seat = self._head_needs(head)
        if free >= need_blocks and not need_seat:
            return
        seats = self._fair.seats(self.running, head.tenant, cfg.max_num_seqs)
        victims: list[Request] = []
        for r in reversed(self.running):
            if free >= need_blocks and not (need_seat and not victims):
                break
            if r.tenant == head.tenant or seats.get(r.tenant, 0.0) <= 0 or \
                    seats.get(head.tenant, 0.0) >= 0:
                continue
            victims.append(r)
            seats[r.tenant] -= 1
            seats[head.tenant] += 1
            free += sum(1 for b in kv.req_to_blocks.get(r.request_id, ()) if b.ref_cnt == 1)
        if free < need_blocks or (need_seat and not victims):
            return
        self._displace(victims, step)

    def _preempt(self, req: Request, step: _Step) -> int:
        """Send ``req`` back to the head of WAITING, recomputing from scratch
        later, or, with room in the host KV tier, swapping its KV out and back
        in (core/kv/tiering.py). Returns the index it had in ``running``."""
        index = self.running.index(req)
        del self.running[index]
        rid = req.request_id
        if rid in step.num_scheduled:
            # Priority victims can come from requests already scheduled this step.
            step.token_budget += step.num_scheduled.pop(rid)
            step.cached_reqs.remove(req)
            step.new_block_ids.pop(rid, None)
            step.spec_tokens.pop(rid, None)
            for input_id in step.encoder_inputs.pop(rid, ()):
                step.encoder_budget += req.mm_features[input_id].length
        self.kv_tiering.on_preempt(req)  # swap its KV out, while it is known
        self.kv_cache_manager.free(req)
        if req.mm_features:
            self.encoder_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)
        step.preempted.append(req)
        return index

    # -- encoder inputs -------------------------------------------------------------
    def _try_schedule_encoder_inputs(self, req: Request, start: int, num_new: int,
                                     step: _Step) -> tuple[list[int], int]:
        """Encoder inputs to run for tokens [start, start + num_new), and the
        possibly shortened token count.

        An item is encoded in the step whose token range first overlaps its
        placeholder. If the budget or the cache cannot take it, the chunk stops
        just before the placeholder."""
        end = start + num_new
        ecm = self.encoder_cache_manager
        to_schedule: list[int] = []
        num_embeds = 0
        for i, f in enumerate(req.mm_features):
            if f.offset >= end:
                break
            if f.offset + f.length <= start:
                continue  # its tokens are already computed
            if ecm.check_and_update_cache(req, i):
                continue
            if any(req.mm_features[j].mm_hash == f.mm_hash for j in to_schedule):
                continue  # the same image twice in this chunk: one encoder run serves both
            if not ecm.can_allocate(req, i, step.encoder_budget - num_embeds, num_embeds):
                num_new = f.offset - start
                break
            to_schedule.append(i)
            num_embeds += f.length
        return to_schedule, num_new

    def _commit_encoder_inputs(self, req: Request, input_ids: list[int], step: _Step) -> None:
        ecm = self.encoder_cache_manager
        for i in input_ids:
            ecm.allocate(req, i)
            step.encoder_budget -= req.mm_features[i].length
        step.encoder_inputs[req.request_id] = input_ids

    # -- output ------------------------------------------------------------------
    def _make_output(self, step: _Step) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = [
            NewRequestData(r.request_id, r.prompt_token_ids, r.mm_features, r.sampling_params,
                           kv.get_block_ids(r.request_id), r.num_computed_tokens, r.lora_id,
                           None if r.sampling_params.ignore_eos else r.eos_token_id,
                           r.pooling_params)
            for r in step.new_reqs]
        scheduled = step.cached_reqs
        req_ids = [r.request_id for r in scheduled]
        cached = CachedRequestData(req_ids, [], [r.num_computed_tokens for r in scheduled])
        if step.resumed:
            for r in scheduled:
                rid = r.request_id
                if rid in step.resumed:
                    cached.new_block_ids.append(kv.get_block_ids(rid))
                    cached.resumed_token_ids[rid] = list(r.all_token_ids)
                else:
                    cached.new_block_ids.append(step.new_block_ids[rid])
        else:
            new_block_ids = step.new_block_ids
            cached.new_block_ids = [new_block_ids[rid] for rid in req_ids]
        finished, self.finished_req_ids = self.finished_req_ids, set()
        num_common = 0
        if self.running and self.cache_config.enable_prefix_caching:
            num_common = kv.get_num_common_prefix_blocks(self.running[0], len(self.running))
        grammar_bitmask, structured_ids = None, []
        som = self.structured_output_manager
        if som is not None:
            if self.defer_grammar_bitmask:
                structured_ids = som.sampling_req_ids(step.num_scheduled, step.spec_tokens)
                grammar_bitmask = Future() if structured_ids else None
            else:
                grammar_bitmask, structured_ids = som.grammar_bitmask(
                    self.requests, step.num_scheduled, step.spec_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.scheduler_config.max_num_batched_tokens
            - step.token_budget,
            scheduled_spec_decode_tokens=step.spec_tokens,
            scheduled_encoder_inputs=step.encoder_inputs,
            num_common_prefix_blocks=num_common,
            finished_req_ids=finished,
            preempted_req_ids={r.request_id for r in step.preempted + step.displaced},
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            grammar_bitmask=grammar_bitmask,
            structured_req_ids=structured_ids,
        )

    def fill_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Resolve a deferred grammar_bitmask from the matchers' current state:
        call once the tokens of every earlier step are accepted. No-op for a
        mask that is already an array, resolved or cancelled."""
        mask = scheduler_output.grammar_bitmask
        if not isinstance(mask, Future) or mask.done():
            return
        try:
            mask.set_result(self.structured_output_manager.fill_bitmask(
                scheduler_output.structured_req_ids,
                scheduler_output.scheduled_spec_decode_tokens))
        except BaseException as exc:  # the worker waiting on it must not hang
            mask.set_exception(exc)
            raise

    def _update_after_schedule(self, step: _Step, out: SchedulerOutput) -> None:
        requests = self.requests
        must_sample = out.must_sample
        placeholders = self.scheduler_config.async_scheduling
        fair = self._fair
        if self._slo is not None:
            self._slo.on_scheduled(sum(step.num_scheduled.values()))
        for rid in step.spec_tokens:
            # Scheduled drafts are spent: a step scheduled before this one's
            # output is known (async) must not verify them again.
            requests[rid].spec_token_ids = []
        if fair is None and not placeholders:
            for rid, n in step.num_scheduled.items():
                requests[rid].num_computed_tokens += n
            return
        for rid, n in step.num_scheduled.items():
            req = requests[rid]
            req.num_computed_tokens += n
            if fair is not None:
                fair.charge(req.tenant, n)
            if placeholders and req.num_computed_tokens >= req.num_tokens:
                # The worker will sample a token we have not seen yet.
                req.num_output_placeholders += 1
                must_sample.add(rid)

    # -- update ------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        if model_runner_output.failed:
            self._fail_requests(model_runner_output.failed)
        som = self.structured_output_manager
        if som is not None and som.fill_failures:
            self._fail_requests(som.take_fill_failures())
        outputs = self.take_side_outputs()
        requests = self.requests
        self.num_stale_drafts = 0
        must_sample = scheduler_output.must_sample
        index_of = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        drafts = model_runner_output.spec_token_ids
        pooled = model_runner_output.pooler_output
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        max_model_len = self.scheduler_config.max_model_len
        finished_running = False
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None:
                continue  # finished or aborted since it was scheduled
            i = index_of.get(rid)
            new = sampled[i] if i is not None and i < len(sampled) else None
            if req.mm_features:
                self._free_computed_encoder_inputs(req)
            if req.pooling_params is not None:
                # Prefill only: it finishes in the step that pooled its whole prompt.
                if pooled is not None and i is not None and pooled[i] is not None:
                    finished_running |= self._finish_pooling(req)
                    outputs.append(RequestOutput(rid, [], "stop", None, req.num_cached_tokens,
                                                 pooling_output=pooled[i]))
                elif new:  # a worker that knows no pooling sampled instead: fail, not hang
                    finished_running |= self._finish_pooling(req, RequestStatus.FINISHED_ABORTED)
                    req.stop_reason = "the worker does not support pooling requests"
                    outputs.append(RequestOutput(
                        rid, [], "abort", None, req.num_cached_tokens, req.stop_reason,
                        UnsupportedRequestError(f"request {rid}: {req.stop_reason} (it "
                                                "returned a token, not a vector); upgrade "
                                                "the worker")))
                continue
            plp = None
            if prompt_logprobs is not None and rid in prompt_logprobs:
                plp = self._new_prompt_logprobs(req, prompt_logprobs[rid])
            if not new:
                if rid in must_sample or req.num_computed_tokens >= \
                        req.num_tokens + req.num_output_placeholders:
                    raise WorkerReplyError(
                        f"the worker's reply has no token for request {rid!r}, which had to "
                        "sample this step; failing the step rather than leave it waiting")
                if plp:  # mid-prefill
                    outputs.append(RequestOutput(rid, [], None, None, req.num_cached_tokens,
                                                 prompt_logprobs=plp))
                continue
            if spec_scheduled:
                scheduled = spec_scheduled.get(rid)
                if scheduled:
                    # Rejected drafts were computed but are not part of the sequence.
                    req.num_computed_tokens -= len(scheduled) + 1 - len(new)
                    self.spec_decoding_stats.observe(len(scheduled), len(new) - 1)
            if req.num_output_placeholders:
                req.num_output_placeholders = max(0, req.num_output_placeholders - len(new))
            status, kept = check_stop(req, new, max_model_len)
            if som is not None and req.structured_request is not None:
                try:
                    if som.accept_tokens(req, kept) and status is None:
                        status = RequestStatus.FINISHED_STOPPED
                        req.stop_reason = "grammar"
                except Exception as exc:  # its matcher broke: it alone fails
                    self._fail_requests({rid: describe(exc)})
                    outputs += self.take_side_outputs()
                    continue
            lp = None
            if logprobs is not None and logprobs[i] is not None:
                lp = logprobs[i][:len(kept)]
            if status is not None:
                if req.status == RequestStatus.RUNNING:
                    finished_running = True
                else:  # async: preempted while its last token was in flight
                    self.waiting.remove_requests([req])
                self._free_request(req, status)
            elif drafts is not None and drafts[i]:
                if req.num_output_placeholders:
                    # Async: a step already in flight extends the sequence these
                    # drafts were proposed for; the engine drains so that the next
                    # proposals are fresh (EngineCore._step_async).
                    self.num_stale_drafts += 1
                else:
                    req.spec_token_ids = self._fit_drafts(req, drafts[i])
            # Positional: a keyword makes the dataclass's __init__ a third slower.
            outputs.append(RequestOutput(rid, kept, RequestStatus.finish_reason(status)
                                         if status is not None else None,
                                         lp, req.num_cached_tokens, req.stop_reason, None, plp))
        if finished_running:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def _finish_pooling(self, req: Request,
                        status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> bool:
        """Free a pooling request whose vector came back; True if it was running."""
        req.num_output_placeholders = 0
        running = req.status == RequestStatus.RUNNING
        if not running:  # async: preempted while its last chunk was in flight
            self.waiting.remove_requests([req])
        self._free_request(req, status)
        return running

    @staticmethod
    def _new_prompt_logprobs(req: Request, computed: PromptLogprobs) -> list | None:
        """The entries not output before (a preempted request recomputes its prompt)."""
        skip = req.num_prompt_logprobs_sent - computed.start
        # Chunks are computed in order from position 0 (no prefix hits): no gap.
        assert skip >= 0, f"{req.request_id}: prompt logprobs from {computed.start}, " \
            f"expected {req.num_prompt_logprobs_sent}"
        entries = computed.entries[skip:]
        if not entries:
            return None
        req.num_prompt_logprobs_sent += len(entries)
        return entries

    def _fit_drafts(self, req: Request, draft: list[int]) -> list[int]:
        cfg = self.scheduler_config
        # Drafts past what the whole cache holds would only preempt the request.
        room = min(cfg.max_model_len, self._pool_tokens - cfg.num_speculative_tokens) \
            - req.num_tokens
        room = min(room, req.max_tokens - req.num_output_tokens) - 1
        draft = draft[:max(room, 0)]
        if draft and req.structured_request is not None:
            draft = self.structured_output_manager.validate_drafts(req, draft)
        return draft

    def _free_computed_encoder_inputs(self, req: Request) -> None:
        # A placeholder fully computed no longer needs the encoder output; the
        # entry stays cached (freeable) for other requests with that image.
        # An image repeated later in the prompt keeps its entry until then.
        computed = req.num_computed_tokens
        pending = {f.mm_hash for f in req.mm_features if f.offset + f.length > computed}
        for i, f in enumerate(req.mm_features):
            if f.offset + f.length > computed:
                break
            if f.mm_hash not in pending:
                self.encoder_cache_manager.free_encoder_input(req, i)
