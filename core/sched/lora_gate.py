"""The LoRA slot limit of a step: at most ``max_loras`` distinct adapters.

The worker holds ``max_loras`` device slots of adapter weights, so no step
may use more distinct adapters than that. The gate keeps a stronger
invariant that implies it: the *running* requests use at most ``max_loras``
distinct adapters, since every scheduled request is running. A running
request keeps its adapter until it finishes or is preempted; a preempted one
comes back through admission like any waiting request. A waiting request
whose adapter would be one too many is skipped for this step (it keeps its
place in the queue), so requests of one adapter keep their FCFS order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.request import Request


class LoRAGate:
    """Admission's check of the adapter limit (built only with LoRA on)."""

    __slots__ = ("max_loras", "_active")

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        # The running requests' adapters, recounted once per admission round.
        self._active: set[int] = set()

    def begin(self, running: list[Request]) -> None:
        self._active = {r.lora_id for r in running if r.lora_id is not None}

    def admits(self, req: Request) -> bool:
        lid = req.lora_id
        return lid is None or lid in self._active or len(self._active) < self.max_loras

    def on_admitted(self, req: Request) -> None:
        if req.lora_id is not None:
            self._active.add(req.lora_id)

    def check(self, scheduled: list[Request]) -> None:
        """The invariant, for tests: a step's requests use at most max_loras adapters."""
        used = {r.lora_id for r in scheduled if r.lora_id is not None}
        assert len(used) <= self.max_loras, f"{len(used)} adapters in one step: {sorted(used)}"
