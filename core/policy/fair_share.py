"""Weighted fair share between tenants (``fair_share``).

Weighted fair queueing over tenants: a tenant's virtual time is the tokens
scheduled for it divided by its weight; the admission order interleaves
tenants, each time taking the next request of the tenant with the least
virtual time (within a tenant, the order the policy gave). A flood from one
tenant thus waits behind the others' requests instead of in front of them. A
tenant that was idle starts at the least virtual time of the busy ones, so
idling banks no credit; an idle tenant is forgotten once it has no debt
left to remember (the busy tenants caught up with it; at most
MAX_IDLE_TENANTS indebted idle tenants are kept).
When the seats (``max_num_seqs``) or KV blocks are full, a tenant below its
weighted share of the seats takes one back from the tenant furthest above
its share (preempting that tenant's latest admitted request). While other
tenants have work, a tenant's prompt tokens per step are capped at its
weighted share of the step's token budget
(``fair_share_chunk_cap``): the step time its prefills add, and so the
others' time per output token, is bounded by its share.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from tokenbudget.core.config import SchedulerConfig
from tokenbudget.core.policy.base import SchedulingPolicy

if TYPE_CHECKING:
    from tokenbudget.core.kv import KVCacheManager
    from tokenbudget.core.policy.base import Admission, StepView
    from tokenbudget.core.policy.queues import FCFSQueue
    from tokenbudget.core.request import Request


# Idle tenants whose virtual time is remembered (they used more than the busy
# ones when they left); beyond it the least indebted are forgotten.
MAX_IDLE_TENANTS = 4096


class FairShare(SchedulingPolicy):
    def __init__(self, config: SchedulerConfig) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.cap_chunks = config.fair_share_chunk_cap
        self.weights = dict(config.tenant_weights or {})
        # Tokens scheduled per tenant divided by its weight.
        self.vtime: dict[str | None, float] = {}
        self._busy: set[str | None] = set()
        self._idle_kept = 0  # idle tenants remembered at the last _forget_idle

    def weight(self, tenant: str | None) -> float:
        return self.weights.get(tenant, 1.0) if tenant is not None else 1.0

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + num_tokens / self.weight(tenant)

    def chunk_caps(
        self, running: list[Request], waiting: FCFSQueue, budget: int
    ) -> dict[str | None, int] | None:
        """Per tenant with work (running or waiting), the prompt tokens it
        may get this step: its weighted share of ``budget``, at least 1.
        None when fewer than two tenants have work."""
        tenants = {r.tenant for r in running}
        tenants.update(r.tenant for r in waiting)
        if len(tenants) < 2:
            return None
        total = sum(self.weight(t) for t in tenants)
        return {t: max(int(budget * self.weight(t) / total), 1) for t in tenants}

    def seats(
        self, running: list[Request], newcomer: str | None, max_num_seqs: int
    ) -> dict[str | None, float]:
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
        if len(vtime) - len(busy) > self._idle_kept:  # a tenant went idle since the last look
            self._forget_idle(busy, floor)
        if len(per_tenant) <= 1:
            return
        # Ties go to the tenant with fewer running requests per weight, then
        # to the earlier arrival.
        seated: dict[str | None, int] = {}
        for r in running:
            seated[r.tenant] = seated.get(r.tenant, 0) + 1
        heap = [
            (vtime.get(t, 0.0), seated.get(t, 0) / self.weight(t), reqs[0].arrival_time, i, t)
            for i, (t, reqs) in enumerate(per_tenant.items())
        ]
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
                heapq.heappush(
                    heap, (v + cost / self.weight(t), share, reqs[position[t]].arrival_time, i, t)
                )
        waiting.reorder(ordered)

    def _forget_idle(self, busy: set[str | None], floor: float) -> None:
        """Drop idle tenants that gain nothing by being remembered: those at or
        below ``floor`` (a returning tenant starts there anyway) and, beyond
        MAX_IDLE_TENANTS, the ones closest to it."""
        vtime = self.vtime
        idle = [t for t in vtime if t not in busy]
        drop = [t for t in idle if vtime[t] <= floor]
        if len(idle) - len(drop) > MAX_IDLE_TENANTS:
            indebted = sorted((t for t in idle if vtime[t] > floor), key=vtime.__getitem__)
            drop += indebted[: len(indebted) - MAX_IDLE_TENANTS]
        for t in drop:
            del vtime[t]
        self._idle_kept = len(idle) - len(drop)

    # -- SchedulingPolicy ----------------------------------------------------------
    def begin_step(self, step: StepView, running: list[Request], waiting) -> None:
        if waiting:
            self.order(waiting, running)  # a displacement looks at the head
        if self.cap_chunks:
            step.tenant_caps = self.chunk_caps(running, waiting, self.budget)

    def order_waiting(
        self, step: StepView, waiting, running: list[Request], kv: KVCacheManager
    ) -> Admission | None:
        self.order(waiting, running)
        return None

    def pick_victim(self, running: list[Request]) -> Request:
        # Memory is short: the tenant furthest above its share gives back.
        seats = self.seats(running, None, self.max_num_seqs)
        worst = max((r.tenant for r in running), key=lambda t: seats[t])
        return next(r for r in reversed(running) if r.tenant == worst)

    def displacement_candidates(self, head: Request, running: list[Request]) -> Iterator[Request]:
        """A tenant below its share of the running seats takes them from the
        tenants above their share, latest admitted first (their blocks stay
        in the prefix cache for their return)."""
        seats = self.seats(running, head.tenant, self.max_num_seqs)
        for r in reversed(running):
            if (
                r.tenant == head.tenant
                or seats.get(r.tenant, 0.0) <= 0
                or seats.get(head.tenant, 0.0) >= 0
            ):
                continue
            seats[r.tenant] -= 1
            seats[head.tenant] += 1
            yield r

    def on_scheduled(
        self, step: StepView, running: list[Request], requests: Mapping[str, Request]
    ) -> None:
        for rid, n in step.num_scheduled.items():
            self.charge(requests[rid].tenant, n)
