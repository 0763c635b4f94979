"""InProcessExecutor: the Executor over a Worker in this process."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.outputs import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenbudget.server.executor.base import Executor
from tokenbudget.worker.worker import Worker


class InProcessExecutor(Executor):
    """Sync: ``execute_model`` runs the step and returns a completed future.
    ``async_mode``: steps go, in order, to one worker thread so the engine can
    schedule step N+1 while step N runs (torch releases the GIL in its kernels)."""

    def __init__(self, worker: Worker, *, async_mode: bool = False) -> None:
        self.worker = worker
        # Async only: the worker thread waits for a pending grammar_bitmask
        # right before sampling while the engine fills it (see server/engine/core.py);
        # a sync step runs on the engine's own thread and would wait forever.
        self.defers_grammar_bitmask = async_mode
        # One thread: the runner's state requires steps to execute in order.
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="tokenbudget-worker") if async_mode else None
        )

    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        return self.worker.initialize(cache_config, scheduler_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._pool is not None:
            return self._pool.submit(self.worker.execute_model, scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.worker.execute_model(scheduler_output))
        except Exception as exc:  # surfaced by future.result() in the engine
            future.set_exception(exc)
        return future

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.worker.shutdown()
