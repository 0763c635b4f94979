"""The phase-free token-budget scheduler.

There is no prefill or decode phase. Every request has ``num_computed_tokens``
and a target, ``num_tokens_with_spec`` (prompt + outputs + draft tokens); each
step hands out at most ``max_num_batched_tokens`` tokens so requests catch up:
running requests first, in order, then waiting ones in queue order.

The step (``schedule``) names no policy: the configured ones act through one
SchedulingPolicy (core/policy/base.py) and the Preemptor (preemption.py).
Beside this module: step.py (the step's ledger and its SchedulerOutput),
preemption.py, encoder_budget.py (encoder inputs per chunk), lifecycle.py
(requests in and out) with intake.py (the checks on arrival), update.py
(reading the step's reply), and remote_kv.py (KV from and for another engine,
through a KVConnector).
"""

from __future__ import annotations

import time

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.failures import DuplicateRequestError, QueueFullError, describe
from tokenbudget.core.kv.connector import KVConnector
from tokenbudget.core.kv.groups import request_capacity_tokens
from tokenbudget.core.kv.tiering import KVTiering
from tokenbudget.core.lora import LoRAConfig
from tokenbudget.core.outputs import RequestOutput, SchedulerOutput
from tokenbudget.core.policy.factory import create_queue, make_policy
from tokenbudget.core.request import Request, RequestStatus
from tokenbudget.core.sched.encoder_budget import EncoderBudget
from tokenbudget.core.sched.encoder_cache import EncoderCacheManager
from tokenbudget.core.sched.lifecycle import RequestLifecycle
from tokenbudget.core.sched.lora_gate import LoRAGate
from tokenbudget.core.sched.preemption import Preemptor
from tokenbudget.core.sched.remote_kv import RemoteKV
from tokenbudget.core.sched.stats import KVGroupUsage, SchedulerStats, SpecDecodingStats
from tokenbudget.core.sched.step import Step, chunk_size, fill_grammar_bitmask, grammar_bitmask
from tokenbudget.core.sched.update import UpdateFromOutput

# Importable from here as before (their homes: core/failures.py, core/sched/stats.py).
__all__ = ["DuplicateRequestError", "QueueFullError", "Scheduler", "SchedulerStats"]


class Scheduler(RequestLifecycle, UpdateFromOutput, RemoteKV):
    """The step (schedule). Requests in and out are RequestLifecycle's
    (core/sched/lifecycle.py); the step's reply is read by
    update_from_output (core/sched/update.py); KV from and for other engines
    goes through RemoteKV (core/sched/remote_kv.py)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        structured_output_manager=None,
        *,
        defer_grammar_bitmask: bool = False,
        lora_config: LoRAConfig | None = None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        """``kv_connector``: where KV comes from and goes to in a disaggregated
        prefill/decode pair (None: every request computes its own KV)."""
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set before building a Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        # The tiering builds the KV cache manager, wired to it at construction.
        self.kv_tiering = KVTiering(cache_config)
        self.kv_cache_manager = self.kv_tiering.kv
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_size)
        self.encoder_budget = EncoderBudget(self.encoder_cache_manager)
        self.structured_output_manager = structured_output_manager
        # At most max_loras distinct adapters per step (None: LoRA off).
        self.lora_config = lora_config
        self.lora_gate = None if lora_config is None else LoRAGate(lora_config.max_loras)
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
        # The configured policies, composed into one (core/policy/base.py), and
        # who preempts for them.
        self.policy = make_policy(scheduler_config, cache_config.block_size)
        self.preemptor = Preemptor(
            self.policy,
            scheduler_config,
            self.kv_cache_manager,
            self.kv_tiering,
            self.encoder_cache_manager,
            self.waiting,
        )
        # Two parts under the names tests read them by (None when off).
        self._slo, self._order = (self.policy.parts.get(k) for k in ("slo", "order"))
        # Outputs produced outside a model step (queue evictions), returned by
        # the next update_from_output.
        self._side_outputs: list[RequestOutput] = []
        self.clock = time.monotonic
        self._init_remote_kv(kv_connector)
        # Tokens the whole KV cache holds: a request needing more can never run.
        self._pool_tokens = request_capacity_tokens(
            cache_config.num_blocks, cache_config.block_size, cache_config.kv_group_windows
        )

    # -- requests in and out: RequestLifecycle (core/sched/lifecycle.py) ----------
    def reset_prefix_cache(self) -> bool:
        return self.kv_tiering.reset()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        t = self.kv_tiering
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            kv.usage(),
            kv.prefix_queries,
            kv.prefix_hits,
            self.num_preemptions,
            self.encoder_cache_manager.usage(),
            self.spec_decoding_stats.copy(),
            t.host.num_usable if t.host is not None else 0,
            t.num_offload_blocks_used(),
            len(t.swapped),
            t.num_recomputed_tokens,
            t.num_swapped_out_blocks,
            t.num_swapped_in_blocks,
            list(map(KVGroupUsage, kv.windows, kv.blocks_in_use_per_group())),
        )

    # -- schedule -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = Step.begin(self.scheduler_config, self.clock())
        self._take_connector_events()  # KV received (those requests run now), failed, freeable
        if self.structured_output_manager is not None:
            self._abort_failed_grammars()
        self.policy.begin_step(step, self.running, self.waiting)
        self.preemptor.displace_for(self.running, step)
        self._schedule_running(step)
        # A step that had to preempt is out of memory: admitting now would
        # only preempt again next step.
        if not step.preempted:
            self._admit_waiting(step)
        out = self._make_output(step)
        self.kv_tiering.finish_step(out)
        self._update_after_schedule(step, out)
        return out

    def _abort_failed_grammars(self) -> None:
        # A grammar that failed to compile (or timed out) ends its request with the error.
        for req, error in self.structured_output_manager.take_failed():
            self._finish_with_output(req, RequestStatus.FINISHED_ABORTED, str(error), error)

    def _schedule_running(self, step: Step) -> None:
        # The hot loop of every step (once per running request): attributes
        # are read once into locals and the budget is kept in a local,
        # written back to ``step`` around the calls that read or change it.
        cfg = self.scheduler_config
        allocate = self.kv_cache_manager.allocate_slots
        threshold, max_model_len = cfg.long_prefill_token_threshold, cfg.max_model_len
        lookahead = cfg.num_speculative_tokens
        running = self.running
        # The policy's order: ``running``, or a copy (slo: decodes, then chunks by slack).
        order = self.policy.order_running(running, step.now)
        num_scheduled, scheduled_reqs = step.num_scheduled, step.cached_reqs
        new_block_ids, budget, caps = step.new_block_ids, step.token_budget, step.tenant_caps
        is_running = RequestStatus.RUNNING
        i = 0
        while i < len(order) and budget > 0:
            req = order[i]
            i += 1
            if req.status is not is_running:
                continue  # a victim preempted earlier this step (``order`` is a copy)
            placeholders = req.num_output_placeholders
            if placeholders and len(req.output_token_ids) + placeholders >= req.max_tokens:
                continue  # async: its last token is already being produced
            computed = req.num_computed_tokens
            num_new = len(req.all_token_ids) + len(req.spec_token_ids) + placeholders - computed
            if num_new > 1:  # one token (a plain decode) is never cut
                num_new = chunk_size(num_new, budget, threshold)
            if num_new > max_model_len - computed:
                num_new = max_model_len - computed
            # A prompt chunk (more than one known token to compute) counts
            # against its tenant's cap; decodes are never held back.
            chunk = caps is not None and len(req.all_token_ids) - computed > 1
            if chunk and num_new > caps[req.tenant]:
                num_new = caps[req.tenant]
            encoder_inputs = None
            if req.mm_features:
                encoder_inputs, num_new = self.encoder_budget.plan(req, computed, num_new, step)
            if num_new <= 0:
                continue
            new_ids = allocate(req, num_new, None, 0, lookahead)
            if new_ids is None:
                step.token_budget = budget
                new_ids, i = self._preempt_until_fits(req, num_new, step, order, i)
                budget = step.token_budget  # a victim scheduled earlier gave its tokens back
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
                self.encoder_budget.commit(req, encoder_inputs, step)
        step.token_budget = budget

    def _preempt_until_fits(
        self, req: Request, num_new: int, step: Step, order: list[Request], i: int
    ) -> tuple[list[int] | None, int]:
        """Memory is short for ``req``'s chunk: preempt the policy's victims
        until it fits (its new block ids), or until ``req`` itself was the
        victim (None). Also returns where the walk over ``order`` goes on."""
        preemptor = self.preemptor
        running = self.running
        lookahead = self.scheduler_config.num_speculative_tokens
        while True:
            victim = preemptor.pick_victim(running)
            if preemptor.preempt(victim, step, running) < i and order is running:
                i -= 1
            if victim is req:
                return None, i
            new_ids = self.kv_cache_manager.allocate_slots(req, num_new, None, 0, lookahead)
            if new_ids is not None:
                return new_ids, i

    def _admit_waiting(self, step: Step) -> None:
        cfg = self.scheduler_config
        if step.token_budget <= 0 or len(self.running) >= cfg.max_num_seqs:
            return
        policy = self.policy
        waiting = self.waiting
        admission = policy.order_waiting(step, waiting, self.running, self.kv_cache_manager)
        deprioritized = ()
        if admission is not None:
            deprioritized = admission.deprioritized
            for req in admission.late:  # refused early: it could not make its deadline
                self._finish_with_output(
                    req, RequestStatus.FINISHED_ABORTED, "cannot meet its TTFT target"
                )
        caps = step.tenant_caps
        skipped: list[Request] = []
        gate = self.lora_gate
        if gate is not None:
            gate.begin(self.running)
        while waiting and step.token_budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = waiting.peek()
            if (
                deprioritized
                and req.request_id in deprioritized
                or caps is not None
                and caps[req.tenant] <= 0
            ):
                skipped.append(waiting.pop())
                continue
            if gate is not None and not gate.admits(req):
                skipped.append(waiting.pop())  # its adapter would be one too many
                continue
            if req.status == RequestStatus.WAITING_FOR_FSM:
                ready = self._grammar_ready(req)
                if ready is None:
                    continue  # failed
                if not ready:
                    # Keep its place in the queue, let the others go.
                    skipped.append(waiting.pop())
                    continue
            if req.num_tokens + cfg.num_speculative_tokens > self._pool_tokens:
                self._fail_outgrown(req)  # else it would block the queue for ever
                continue
            if not self._try_admit(req, step, policy):
                break
        for req in reversed(skipped):
            waiting.prepend(req)

    def _grammar_ready(self, req: Request) -> bool | None:
        """Whether a request waiting for its grammar may run; None when it
        failed (its matcher cannot be built: it alone fails)."""
        try:
            ready = self.structured_output_manager.is_ready(req)
        except Exception as exc:
            self._fail_requests({req.request_id: describe(exc)})
            return None
        if ready:
            req.status = RequestStatus.WAITING
        return ready

    def _try_admit(self, req: Request, step: Step, policy) -> bool:
        """Admit the head of the queue with its first chunk; False when it
        does not fit now (admission stops there)."""
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        if self._kv_arrived(req):
            return self._admit_received(req, step, policy)
        hits, num_cached = kv.get_computed_blocks(req)
        if self._wants_remote_kv(req, num_cached):
            # Parked until its KV arrives, no budget spent: admission goes on.
            return self._admit_for_remote_kv(req, hits, num_cached, policy)
        # Past the device hits, the host tier may hold more (or its swapped KV).
        load = self.kv_tiering.plan_load(req, hits, num_cached)
        if load is None:
            return False  # its swap-in waits for the next step's copy budget
        loads, num_cached = load
        num_new = chunk_size(
            req.num_tokens - num_cached, step.token_budget, cfg.long_prefill_token_threshold
        )
        caps = step.tenant_caps
        if caps is not None and num_new > caps[req.tenant]:
            num_new = caps[req.tenant]
        encoder_inputs = None
        if req.mm_features:
            encoder_inputs, num_new = self.encoder_budget.plan(req, num_cached, num_new, step)
        new_ids = None
        if num_new > 0 and policy.admits(req, num_new, hits, num_cached):
            new_ids = kv.allocate_slots(req, num_new, hits, num_cached, cfg.num_speculative_tokens)
        if new_ids is None:
            self.kv_tiering.cancel_load(loads)
            if req.mm_features:
                # Drop the encoder-cache references the lookup just took:
                # a waiting request must not pin entries.
                self.encoder_cache_manager.free(req)
            return False
        policy.on_admitted(req)
        self.waiting.pop()
        self.kv_tiering.commit_load(req, hits, loads, num_cached)
        kv.record_prefix_lookup(req, num_cached)
        self._start_running(req, step, num_cached, num_new)
        if encoder_inputs:
            self.encoder_budget.commit(req, encoder_inputs, step)
        return True

    def _start_running(self, req: Request, step: Step, num_cached: int, num_new: int) -> None:
        self.running.append(req)
        if self.lora_gate is not None:
            self.lora_gate.on_admitted(req)
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
        if step.tenant_caps is not None:
            step.tenant_caps[req.tenant] -= num_new

    # -- output ------------------------------------------------------------------
    def _make_output(self, step: Step) -> SchedulerOutput:
        kv = self.kv_cache_manager
        finished, self.finished_req_ids = self.finished_req_ids, set()
        num_common = 0
        if self.running and self.cache_config.enable_prefix_caching:
            num_common = kv.get_num_common_prefix_blocks(self.running[0], len(self.running))
        grammar = grammar_bitmask(
            step, self.structured_output_manager, self.requests, self.defer_grammar_bitmask
        )
        out = step.build_output(
            kv,
            self.scheduler_config.max_num_batched_tokens,
            finished=finished,
            num_common_prefix_blocks=num_common,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            grammar=grammar,
        )
        self._add_connector_metadata(out)
        return out

    def fill_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Resolve a deferred grammar_bitmask from the matchers' current state:
        call once the tokens of every earlier step are accepted. No-op for a
        mask that is already an array, resolved or cancelled."""
        fill_grammar_bitmask(self.structured_output_manager, scheduler_output)

    def _update_after_schedule(self, step: Step, out: SchedulerOutput) -> None:
        requests = self.requests
        self.num_preemptions += len(step.preempted) + len(step.displaced)
        self.policy.on_scheduled(step, self.running, requests)
        for rid in step.spec_tokens:
            # Scheduled drafts are spent: a step scheduled before this one's
            # output is known (async) must not verify them again.
            requests[rid].spec_token_ids = []
        if not self.scheduler_config.async_scheduling:
            for rid, n in step.num_scheduled.items():
                requests[rid].num_computed_tokens += n
            return
        must_sample = out.must_sample
        for rid, n in step.num_scheduled.items():
            req = requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                # The worker will sample a token we have not seen yet.
                req.num_output_placeholders += 1
                must_sample.add(rid)
