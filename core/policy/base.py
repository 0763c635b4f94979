"""What a scheduling policy may change in a step, and the chunk rule.

The scheduler (core/sched/scheduler.py) names no policy: it calls the hooks
of one ``SchedulingPolicy``, which make_policy (core/policy/factory.py)
composes from the parts the config turns on. Every hook has a no-op default,
so a part implements only the hooks it needs:

==========================  ==================================================
hook                        implemented by
==========================  ==================================================
begin_step                  reserve (ratio decay), slo (step clock),
                            fair share (admission order, per-tenant caps)
order_running               slo (decodes, then prompt chunks by slack)
order_waiting               cache-aware orders, slo (late ones to refuse),
                            fair share (interleave tenants), reserve (round)
admits, on_admitted         reserve (keep room for the running requests)
pick_victim                 victim order (vllm, priority, retract), fair share
displacement_candidates     priority, fair share
on_scheduled                slo (tokens), fair share (charge), reserve
                            (re-estimate after a preemption)
==========================  ==================================================

Policies sit below the scheduler and may not import it; ``StepView`` is what
they see of its step ledger (core/sched/step.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from tokenbudget.core.kv import KVCacheBlock, KVCacheManager
    from tokenbudget.core.request import Request


def chunk_size(num_left: int, budget: int, threshold: int) -> int:
    """The tokens a request with ``num_left`` to compute gets in a step with
    ``budget`` tokens left: all of them, but at most the long-prefill
    threshold (0: no threshold) and the budget. The one chunk rule: the
    scheduler, the displacement plan and the slo estimates all use it."""
    if 0 < threshold < num_left:
        num_left = threshold
    return num_left if num_left < budget else budget


def blocks_to_admit(
    kv: KVCacheManager, hits: list[KVCacheBlock], num_cached: int, num_new: int
) -> int:
    """Free blocks ``kv.allocate_slots`` takes to admit a request with its
    prefix ``hits`` (``num_cached`` tokens) and ``num_new`` more tokens: in
    every KV cache group a block per ``block_size`` tokens past the hit, and
    the hit blocks it revives from the free queue. With groups
    (core/kv/groups.py) ``hits`` as a list is the first group's; each
    group's table is in ``hits.tables``."""
    tables = getattr(hits, "tables", (hits,))
    per_group = -(-(num_cached + num_new) // kv.block_size) - len(hits)
    null = kv.block_pool.null_block
    # Hit blocks sitting in the free queue stop being free once touched.
    revived = sum(1 for t in tables for b in t if b.ref_cnt == 0 and b is not null)
    return max(per_group, 0) * len(kv.windows) + revived


class StepView(Protocol):
    """The parts of a step's ledger a policy reads or sets."""

    now: float
    token_budget: int
    num_scheduled: dict[str, int]
    # Memory preemptions this step (displacements are not among them).
    preempted: list[Request]
    # Prompt tokens each tenant may still get this step (None: no caps).
    tenant_caps: dict[str | None, int] | None


class Admission(NamedTuple):
    """What ordering the waiting queue decided for this step's admission."""

    # Ids that keep their place but are not admitted this step.
    deprioritized: set[str]
    # Requests taken out of the queue, to be refused (they would be late).
    late: list[Request]


class SchedulingPolicy(Protocol):
    """The hooks of a policy, called by the scheduler at fixed points of a
    step; each default changes nothing. A policy part subclasses this class
    and overrides what it needs."""

    def begin_step(self, step: StepView, running: list[Request], waiting) -> None:
        """At the start of a step, before any displacement or scheduling."""

    def order_running(self, running: list[Request], now: float) -> list[Request]:
        """The order the running requests get this step's tokens in:
        ``running`` itself, or a copy."""
        return running

    def order_waiting(
        self, step: StepView, waiting, running: list[Request], kv: KVCacheManager
    ) -> Admission | None:
        """Before admission (when a seat and budget are left): order
        ``waiting`` in place; None or what admission must skip or refuse."""
        return None

    def admits(self, req: Request, num_new: int, hits: list[KVCacheBlock], num_cached: int) -> bool:
        """Whether ``req`` may take ``num_new`` tokens' blocks now (its
        ``hits`` are prefix-cache blocks covering ``num_cached`` tokens)."""
        return True

    def on_admitted(self, req: Request) -> None:
        """``req`` was admitted in this round of admission."""

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when memory is short."""
        return running[-1]

    def displacement_candidates(
        self, head: Request, running: list[Request]
    ) -> Iterable[Request] | None:
        """Running requests the waiting ``head`` may displace, in the order
        they are taken (lazily: the plan stops once the head fits); None
        when this policy never displaces."""
        return None

    def on_scheduled(
        self, step: StepView, running: list[Request], requests: Mapping[str, Request]
    ) -> None:
        """The step is scheduled (``requests``: every unfinished one by id)."""


def implements(policy: SchedulingPolicy, hook: str) -> bool:
    """Whether ``policy`` does anything on ``hook``: a method of its own, or
    for a composed policy (core/policy/factory.py) one of a part's."""
    method = getattr(policy, hook)
    return getattr(method, "__func__", None) is not getattr(SchedulingPolicy, hook)
