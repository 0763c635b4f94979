"""The policy the config asks for: its waiting queue, and one
SchedulingPolicy composed of the parts it turns on."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tokenbudget.core.config import SchedulerConfig
from tokenbudget.core.policy.base import Admission, SchedulingPolicy, implements
from tokenbudget.core.policy.cache_aware import REORDERING_POLICIES, VictimOrder, WaitingOrder
from tokenbudget.core.policy.fair_share import FairShare
from tokenbudget.core.policy.priority import PriorityDisplacement
from tokenbudget.core.policy.queues import FCFSQueue, PriorityQueue
from tokenbudget.core.policy.reserve import AdmissionReserve
from tokenbudget.core.policy.slo import SLOOrder
from tokenbudget.core.policy.slo_queue import SLOQueue

if TYPE_CHECKING:
    from tokenbudget.core.kv import KVCacheManager
    from tokenbudget.core.policy.base import StepView
    from tokenbudget.core.request import Request

# Hooks every implementing part runs for, in order (their results combined).
_EACH = ("begin_step", "order_running", "order_waiting", "admits", "on_admitted", "on_scheduled")
# Hooks only the first implementing part answers.
_FIRST = ("pick_victim", "displacement_candidates")


def create_queue(policy: str, descending: bool = False) -> FCFSQueue | PriorityQueue | SLOQueue:
    if policy == "priority":
        return PriorityQueue(descending)
    # slo: kept in deadline order as requests come (core/policy/slo_queue.py).
    return SLOQueue() if policy == "slo" else FCFSQueue()


def make_policy(config: SchedulerConfig, block_size: int) -> PolicySet:
    """The parts ``config`` turns on, composed. Their order is the order
    their hooks run in: the waiting order (cache-aware or slo) before the
    fair interleaving of tenants, the reserve last to see the admission
    round; fair share chooses memory victims before the plain victim order."""
    parts: dict[str, SchedulingPolicy] = {}
    if config.policy in REORDERING_POLICIES:
        parts["order"] = WaitingOrder(config, block_size)
    if config.policy == "slo":
        parts["slo"] = SLOOrder(config)
    if config.fair_share:
        parts["fair_share"] = FairShare(config)
    if config.use_admission_reserve:
        parts["reserve"] = AdmissionReserve(config, block_size)
    if config.policy == "priority" and config.priority_preemption_threshold >= 0:
        parts["priority"] = PriorityDisplacement(config)
    parts["victims"] = VictimOrder(config)
    return PolicySet(parts)


class PolicySet(SchedulingPolicy):
    """Several parts behind one policy. A hook that one part implements is
    that part's method itself (no dispatch cost); one that several
    implement runs them in order and combines what they return."""

    def __init__(self, parts: dict[str, SchedulingPolicy]) -> None:
        self.parts = parts
        for hook in _EACH + _FIRST:
            impls = [getattr(p, hook) for p in parts.values() if implements(p, hook)]
            if len(impls) == 1 or impls and hook in _FIRST:
                setattr(self, hook, impls[0])
            elif impls:
                setattr(self, hook, getattr(self, "_all_" + hook)(impls))

    # Combinations, for a hook that several parts implement.
    @staticmethod
    def _all_begin_step(impls: list[Callable]) -> Callable:
        return lambda step, running, waiting: _each(impls, step, running, waiting)

    @staticmethod
    def _all_on_admitted(impls: list[Callable]) -> Callable:
        return lambda req: _each(impls, req)

    @staticmethod
    def _all_on_scheduled(impls: list[Callable]) -> Callable:
        return lambda step, running, requests: _each(impls, step, running, requests)

    @staticmethod
    def _all_admits(impls: list[Callable]) -> Callable:
        return lambda *args: all(f(*args) for f in impls)

    @staticmethod
    def _all_order_running(impls: list[Callable]) -> Callable:
        def order_running(running: list[Request], now: float) -> list[Request]:
            for f in impls:
                running = f(running, now)
            return running

        return order_running

    @staticmethod
    def _all_order_waiting(impls: list[Callable]) -> Callable:
        def order_waiting(
            step: StepView, waiting, running: list[Request], kv: KVCacheManager
        ) -> Admission | None:
            deprioritized: set[str] = set()
            late: list[Request] = []
            for f in impls:
                got = f(step, waiting, running, kv)
                if got is not None:
                    deprioritized |= got.deprioritized
                    late += got.late
            return Admission(deprioritized, late) if deprioritized or late else None

        return order_waiting


def _each(impls: Iterable[Callable], *args: Any) -> None:
    for f in impls:
        f(*args)
