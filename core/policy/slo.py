"""SLO-aware order (policy "slo").

Requests carry latency targets (``ttft_ms``, ``tpot_ms``). Each step the
waiting queue is ordered by TTFT deadline (earliest first). Walking that
order, the scheduler estimates when each request would get its first token
(the steps its prefill and the prefills ahead of it need, times the step
time); a request that would miss its deadline is *late*: serving it adds no
goodput, so it waits behind every request that can still make it, or is
refused at once (``slo_reject_late``). Aging keeps that from starving
anyone: a request waiting longer than ``aging_bound_s`` goes first, in
arrival order. The queue (core/policy/slo_queue.py) owns that order: it keeps
itself sorted as requests come, so a step walks only the requests still
before their deadline; this policy gives it the step time it learns and the
settings.

Running requests get the step's tokens decodes first (their next token is
due within a TPOT), then prompt chunks by slack, least first: the time left
to the TTFT deadline minus the steps the rest of the prompt needs. A request
admitted late with a close deadline thus gets its chunk before an earlier
one with time to spare; one that will miss its deadline anyway goes last,
with those that have none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tokenbudget.core.config import SchedulerConfig
from tokenbudget.core.policy import slo_queue
from tokenbudget.core.policy.base import Admission, SchedulingPolicy, chunk_size

if TYPE_CHECKING:
    from tokenbudget.core.kv import KVCacheManager
    from tokenbudget.core.policy.base import StepView
    from tokenbudget.core.policy.slo_queue import SLOQueue
    from tokenbudget.core.request import Request


class SLOOrder(SchedulingPolicy):
    def __init__(self, config: SchedulerConfig) -> None:
        self.aging_s = config.aging_bound_s
        self.reject_late = config.slo_reject_late
        self.budget = config.max_num_batched_tokens
        # The most tokens one request's chunk gets in a step.
        self.max_chunk = chunk_size(self.budget, self.budget, config.long_prefill_token_threshold)
        self.fixed_step_s = config.slo_step_time_ms / 1000.0
        # Learned step time: the time between two schedule() calls with
        # requests running across both (otherwise the gap may hold idle time).
        self.step_s = self.fixed_step_s
        self._last_schedule: float | None = None
        self._last_tokens = 0

    def on_schedule(self, now: float, busy: bool) -> None:
        if busy and not self.fixed_step_s and self._last_schedule is not None and self._last_tokens:
            dt = now - self._last_schedule
            self.step_s = dt if not self.step_s else 0.8 * self.step_s + 0.2 * dt
        self._last_schedule = now

    deadline = staticmethod(slo_queue.deadline)

    def chunk_order(self, running: list[Request], now: float) -> list[Request]:
        """The order ``running`` gets this step's tokens in: decodes in
        running order, then prompt chunks by slack (ties: running order).
        ``running`` itself when every request decodes."""
        decodes: list[Request] = []
        chunks: list[tuple[float, int, Request]] = []
        max_chunk, step_s = self.max_chunk, self.step_s
        deadline = slo_queue.deadline
        for i, r in enumerate(running):
            left = len(r.all_token_ids) - r.num_computed_tokens
            if left > 1:
                due = deadline(r)
                slack = due - now - -(-left // max_chunk) * step_s
                if slack < 0 and due != -math.inf:
                    # Late anyway: serving it first would only make others late too.
                    slack = math.inf
                chunks.append((slack, i, r))
            else:
                decodes.append(r)
        if not chunks:
            return running
        chunks.sort(key=lambda c: (c[0], c[1]))
        return decodes + [r for _, _, r in chunks]

    def reorder(self, waiting: SLOQueue, now: float, num_decoding: int) -> list[Request]:
        """Order ``waiting`` for this step; return the late requests when they
        are to be refused (they are left out of the queue's order then)."""
        if not waiting:
            return []
        # Prefill tokens per step left over by the running requests' decodes.
        per_step = max(self.budget - num_decoding, 1)
        return waiting.arrange(self, now, per_step)

    def order_all(
        self, waiting: list[Request], now: float, per_step: int
    ) -> tuple[list[Request], list[Request], list[Request]]:
        """The aged, on-time and late requests of ``waiting`` (in its current
        order, which breaks ties), each in the order they are served."""
        return slo_queue.order_all(waiting, now, per_step, self.aging_s, self.step_s)

    # -- SchedulingPolicy ----------------------------------------------------------
    def begin_step(self, step: StepView, running: list[Request], waiting) -> None:
        self.on_schedule(step.now, bool(running))

    def order_running(self, running: list[Request], now: float) -> list[Request]:
        return self.chunk_order(running, now)

    def order_waiting(
        self, step: StepView, waiting, running: list[Request], kv: KVCacheManager
    ) -> Admission | None:
        decoding = sum(1 for r in running if r.num_computed_tokens >= r.num_tokens)
        late = self.reorder(waiting, step.now, decoding)
        # Refused early: they could not meet their TTFT target anyway.
        return Admission(set(), late) if late else None

    def on_scheduled(
        self, step: StepView, running: list[Request], requests: Mapping[str, Request]
    ) -> None:
        self._last_tokens = sum(step.num_scheduled.values())
