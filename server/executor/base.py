"""Executor: the engine side of the core/worker contract.

Three methods every executor has (``initialize``, ``execute_model``,
``shutdown``) and the capabilities some have, each declared here with the
default an executor without it gets, so the engine asks instead of probing:

- ``defers_grammar_bitmask`` (False): ``execute_model`` accepts a step whose
  grammar bitmask is still a Future, filled once the step before it is
  applied (its worker waits on it right before sampling). The engine then
  overlaps steps while structured requests sample.
- ``can_reinitialize`` / ``reinitialize()`` (not supported): workers that went
  away (a ConnectionError from a step) can come back; ``reinitialize`` sends
  them the same configuration again and returns their KVCacheSpec.
- ``add_failure_callback(callback)`` (never called): ``callback(exc)`` runs
  when a worker fails while no step waits on it, so an idle engine notices.

``as_executor`` adapts an object written to the old duck-typed protocol (the
three methods; ``initialize`` returning a block count).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.outputs import KVCacheSpec, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    defers_grammar_bitmask: bool = False

    @abstractmethod
    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        """Load the model and allocate the KV cache ``cache_config`` asks for;
        return what was allocated. ``cache_config`` is not written to."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send one step; its future resolves to the step's output (in order)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold."""

    @property
    def can_reinitialize(self) -> bool:
        """Whether ``reinitialize`` is supported (workers that can come back)."""
        return False

    def reinitialize(self) -> KVCacheSpec:
        """Reconnect the workers and initialise them again with the same
        configuration; raises ConnectionError while they cannot be reached."""
        raise NotImplementedError(f"{type(self).__name__} cannot reinitialize its workers")

    def add_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Have ``callback(exc)`` run when a worker fails (default: workers
        that fail only inside a step, where its future carries the error)."""


def kv_cache_spec(reported: KVCacheSpec | int, cache_config: CacheConfig) -> KVCacheSpec:
    """``reported`` as a KVCacheSpec: a bare block count (the old protocol)
    gets the host tier ``cache_config`` asked for in blocks."""
    if isinstance(reported, KVCacheSpec):
        return reported
    return KVCacheSpec(int(reported), cache_config.num_offload_blocks or 0)


def as_executor(executor: Any) -> Executor:
    """``executor`` itself if it is an Executor; else an Executor over an
    object with the three methods (a test double, a wrapper), reading the
    capabilities it declares by name once, here."""
    if isinstance(executor, Executor):
        return executor
    return _Adapted(executor)


class _Adapted(Executor):
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.defers_grammar_bitmask = bool(getattr(inner, "defers_grammar_bitmask", False))
        self._reinitialize = getattr(inner, "reinitialize", None)
        self._add_failure_callback = getattr(inner, "add_failure_callback", None)
        self._cache_config: CacheConfig | None = None

    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        self._cache_config = cache_config
        return kv_cache_spec(self.inner.initialize(cache_config, scheduler_config), cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        return self.inner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.inner.shutdown()

    @property
    def can_reinitialize(self) -> bool:
        return self._reinitialize is not None

    def reinitialize(self) -> KVCacheSpec:
        if self._reinitialize is None:
            return super().reinitialize()
        return kv_cache_spec(self._reinitialize(), self._cache_config or CacheConfig())

    def add_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        if self._add_failure_callback is not None:
            self._add_failure_callback(callback)
