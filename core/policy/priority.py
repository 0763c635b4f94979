"""Priority displacement (policy priority): the best waiting request may
take the place of running requests whose priority is worse by more than
``priority_preemption_threshold``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenbudget.core.config import SchedulerConfig
from tokenbudget.core.policy.base import SchedulingPolicy

if TYPE_CHECKING:
    from tokenbudget.core.request import Request


class PriorityDisplacement(SchedulingPolicy):
    def __init__(self, config: SchedulerConfig) -> None:
        self.sign = -1 if config.priority_descending else 1
        self.threshold = config.priority_preemption_threshold

    def displacement_candidates(self, head: Request, running: list[Request]) -> list[Request]:
        """The running requests worse than ``head`` by more than the
        threshold, worst first (the latest arrival first among equals)."""
        sign = self.sign
        bar = sign * head.priority + self.threshold
        return sorted(
            (r for r in running if sign * r.priority > bar),
            key=lambda r: (sign * r.priority, r.arrival_time),
            reverse=True,
        )
