"""SLO-aware and tenant-fair admission order.

- ``SLOOrder`` (policy "slo"): requests carry latency targets (``ttft_ms``,
  ``tpot_ms``). Each step the waiting queue is ordered by TTFT deadline
  (earliest first). Walking that order, the scheduler estimates when each
  request would get its first token (the steps its prefill and the prefills
  ahead of it need, times the step time); a request that would miss its
  deadline is *late*: serving it adds no goodput, so it waits behind every
  request that can still make it, or is refused at once
  (``slo_reject_late``). Aging keeps that from starving anyone: a request
  waiting longer than ``aging_bound_s`` goes first, in arrival order. The
  queue (core/policy/slo_queue.py) keeps itself in that order as requests come, so
  a step walks only the requests still before their deadline.
  Running requests get the step's tokens decodes first (their next token is
  due within a TPOT), then prompt chunks by slack, least first: the time
  left to the TTFT deadline minus the steps the rest of the prompt needs. A
  request admitted late with a close deadline thus gets its chunk before an
  earlier one with time to spare; one that will miss its deadline anyway
  goes last, with those that have none.
- ``FairShare`` (``fair_share``): weighted fair queueing over tenants. A
  tenant's virtual time is the tokens scheduled for it divided by its weight;
  the admission order interleaves tenants, each time taking the next request
  of the tenant with the least virtual time (within a tenant, the order the
  policy gave). A flood from one tenant thus waits behind the others' requests
  instead of in front of them. A tenant that was idle starts at the least
  virtual time of the busy ones, so idling banks no credit. When the seats
  (``max_num_seqs``) or KV blocks are full, a tenant below its weighted share
  of the seats takes one back from the tenant furthest above its share
  (preempting that tenant's latest admitted request). While other tenants
  have work, a tenant's prompt tokens per step are capped at its weighted
  share of the step's token budget (``fair_share_chunk_cap``): the step time
  its prefills add, and so the others' time per output token, is bounded by
  its share.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenbudget.core.config import SchedulerConfig

if TYPE_CHECKING:
    from tokenbudget.core.policy.queues import FCFSQueue
    from tokenbudget.core.request import Request
    from tokenbudget.core.policy.slo_queue import SLOQueue


class SLOOrder:
    def __init__(self, config: SchedulerConfig) -> None:
        self.aging_s = config.aging_bound_s
        self.reject_late = config.slo_reject_late
        self.budget = config.max_num_batched_tokens
        # The most tokens one request's chunk gets in a step.
        threshold = config.long_prefill_token_threshold
        self.max_chunk = threshold if 0 < threshold < self.budget else self.budget
        self.fixed_step_s = config.slo_step_time_ms / 1000.0
        # Learned step time: the time between two schedule() calls with
        # requests running across both (otherwise the gap may hold idle time).
        self.step_s = self.fixed_step_s
        self._last_schedule: float | None = None
        self._last_tokens = 0

    def on_schedule(self, now: float, busy: bool) -> None:
        if busy and not self.fixed_step_s and self._last_schedule is not None and \
                self._last_tokens:
            dt = now - self._last_schedule
            self.step_s = dt if not self.step_s else 0.8 * self.step_s + 0.2 * dt
        self._last_schedule = now

    def on_scheduled(self, num_tokens: int) -> None:
        self._last_tokens = num_tokens

    @staticmethod
    def deadline(req: Request) -> float:
        """When the request's first token is due. A request that already has
        output (it was preempted) has met its TTFT: it is never late, and goes
        back ahead of every request still waiting for its first token (only
        the aged go before it)."""
        if req.num_output_tokens:
            return -math.inf
        if req.ttft_ms is None:
            return math.inf
        return req.arrival_time + req.ttft_ms / 1000.0

    def chunk_order(self, running: list[Request], now: float) -> list[Request]:
        """The order ``running`` gets this step's tokens in: decodes in
        running order, then prompt chunks by slack (ties: running order).
        ``running`` itself when every request decodes."""
        decodes: list[Request] = []
        chunks: list[tuple[float, int, Request]] = []
        max_chunk, step_s = self.max_chunk, self.step_s
        for i, r in enumerate(running):
            left = len(r.all_token_ids) - r.num_computed_tokens
            if left > 1:
                due = self.deadline(r)
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

    def walk(self, rest: Iterable[tuple[float, float, int, Request]], ahead: int, now: float,
             per_step: int) -> tuple[list[Request], list[Request]]:
        """Split ``rest`` ((deadline, arrival, position, request) in that
        order) into the requests that can still get their first token by
        their deadline with ``ahead`` prompt tokens before them, and the late."""
        step_s = self.step_s
        on_time: list[Request] = []
        late: list[Request] = []
        for due, _, _, r in rest:
            prefill = len(r.all_token_ids) - r.num_computed_tokens
            # The first token comes at the end of the step that finishes the prefill.
            first_token = now + ((ahead + prefill - 1) // per_step + 1) * step_s
            if first_token > due:
                late.append(r)
            else:
                on_time.append(r)
                ahead += prefill
        return on_time, late

    def order_all(self, waiting: list[Request], now: float,
                  per_step: int) -> tuple[list[Request], list[Request], list[Request]]:
        """The aged, on-time and late requests of ``waiting`` (in its current
        order, which breaks ties), each in the order they are served."""
        aged: list[Request] = []
        rest: list[tuple[float, float, int, Request]] = []
        bound = now - self.aging_s if self.aging_s > 0 else -math.inf
        deadline = self.deadline
        for i, r in enumerate(waiting):
            arrival = r.arrival_time
            if arrival <= bound:
                aged.append(r)
            else:
                rest.append((deadline(r), arrival, i, r))
        aged.sort(key=lambda r: r.arrival_time)
        # Plainly sorted: ties stay in queue order, as in a stable sort by (deadline, arrival).
        rest.sort()
        # Preempted with output (deadline -inf, sorted first): resumed, never late.
        k = bisect_right(rest, (-math.inf, math.inf))
        aged += [e[3] for e in rest[:k]]
        ahead = sum(r.num_tokens - r.num_computed_tokens for r in aged)
        return (aged, *self.walk(rest[k:], ahead, now, per_step))


class FairShare:
    def __init__(self, config: SchedulerConfig) -> None:
        self.weights = dict(config.tenant_weights or {})
        # Tokens scheduled per tenant divided by its weight.
        self.vtime: dict[str | None, float] = {}
        self._busy: set[str | None] = set()

    def weight(self, tenant: str | None) -> float:
        return self.weights.get(tenant, 1.0) if tenant is not None else 1.0

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + num_tokens / self.weight(tenant)

    def chunk_caps(self, running: list[Request], waiting: FCFSQueue,
                   budget: int) -> dict[str | None, int] | None:
        """Per tenant with work (running or waiting), the prompt tokens it
        may get this step: its weighted share of ``budget``, at least 1.
        None when fewer than two tenants have work."""
        tenants = {r.tenant for r in running}
        tenants.update(r.tenant for r in waiting)
        if len(tenants) < 2:
            return None
        total = sum(self.weight(t) for t in tenants)
        return {t: max(int(budget * self.weight(t) / total), 1) for t in tenants}

    def seats(self, running: list[Request], newcomer: str | None,
              max_num_seqs: int) -> dict[str | None, float]:
        """Running requests per tenant minus its weighted share of
        ``max_num_seqs`` among the tenants running or arriving (> 0: above
        its share)."""
        count: dict[str | None, int] = {newcomer: 0}
        for r in running:
            count[r.tenant] = count.get(r.tenant, 0) + 1
        total = sum(self.weight(t) for t in count)
        return {t: n - max_num_seqs * self.weight(t) / total for t, n in count.items()}

    def order(self, waiting: FCFSQueue, running: list[Request]) -> None:
        """Interleave ``waiting`` by tenant virtual time, keeping each tenant's
        own order."""
        per_tenant: dict[str | None, list[Request]] = {}
        for r in waiting:
            per_tenant.setdefault(r.tenant, []).append(r)
        busy = set(per_tenant)
        busy.update(r.tenant for r in running)
        vtime = self.vtime
        before = [vtime.get(t, 0.0) for t in self._busy & busy]
        floor = min(before) if before else min((vtime.get(t, 0.0) for t in busy), default=0.0)
        for t in busy - self._busy:
            if vtime.get(t, 0.0) < floor:
                vtime[t] = floor
        self._busy = busy
        if len(per_tenant) <= 1:
            return
        # Ties go to the tenant with fewer running requests per weight, then
        # to the earlier arrival.
        seated: dict[str | None, int] = {}
        for r in running:
            seated[r.tenant] = seated.get(r.tenant, 0) + 1
        heap = [(vtime.get(t, 0.0), seated.get(t, 0) / self.weight(t), reqs[0].arrival_time,
                 i, t) for i, (t, reqs) in enumerate(per_tenant.items())]
        heapq.heapify(heap)
        position = dict.fromkeys(per_tenant, 0)
        ordered: list[Request] = []
        while heap:
            v, share, _, i, t = heapq.heappop(heap)
            reqs = per_tenant[t]
            r = reqs[position[t]]
            ordered.append(r)
            position[t] += 1
            if position[t] < len(reqs):
                # What admitting r will cost this tenant: its prefill.
                cost = r.num_tokens - r.num_computed_tokens
                heapq.heappush(heap, (v + cost / self.weight(t), share,
                                      reqs[position[t]].arrival_time, i, t))
        waiting.reorder(ordered)
