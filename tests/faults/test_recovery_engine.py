"""The engine's side of a worker failure, in one process with a scripted
executor: the failed requests are forgotten (no running or waiting request,
every KV block free, the prefix cache empty), reconnection is retried with
backoff, a worker that comes back with another KV size gets a pool of that
size, and the engine then serves again. (tests/faults/test_worker_faults.py
does the same with real processes.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tokenbudget.core import CacheConfig, ModelRunnerOutput, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.core.request import Request
from tokenbudget.server.engine.async_engine import AsyncEngine, EngineDeadError


class FlakyExecutor:
    """One token (7) per request whose prompt is done, 2 ms a step. ``fail()``
    loses the worker: pending and later steps fail and the failure callbacks
    fire; ``reinitialize`` refuses ``refusals`` times, then reports
    ``blocks_after``."""

    def __init__(self, blocks: int, blocks_after: int, refusals: int) -> None:
        self.blocks, self.blocks_after, self.refusals = blocks, blocks_after, refusals
        self.reinitialize_calls: list[float] = []
        self.callbacks = []
        self.gone: Exception | None = None
        self._pool = ThreadPoolExecutor(1)
        self._prompt_len: dict[str, int] = {}

    def add_failure_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def initialize(self, cache_config, scheduler_config) -> int:
        return self.blocks

    def reinitialize(self) -> int:
        self.reinitialize_calls.append(time.monotonic())
        if len(self.reinitialize_calls) <= self.refusals:
            raise ConnectionError("worker 127.0.0.1:1: UNAVAILABLE: connection refused")
        self.gone = None
        self._prompt_len.clear()  # a new worker knows no request
        return self.blocks_after

    def fail(self) -> None:
        self.gone = ConnectionError("worker 127.0.0.1:1: UNAVAILABLE: Socket closed")
        for callback in self.callbacks:
            callback(self.gone)

    def execute_model(self, so) -> Future:
        for r in so.scheduled_new_reqs:
            self._prompt_len[r.req_id] = len(r.prompt_token_ids)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(
            zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens)
        )

        def run() -> ModelRunnerOutput:
            time.sleep(0.002)
            if self.gone is not None:
                raise self.gone
            ids = list(so.num_scheduled_tokens)
            sampled = [
                [7] if computed[r] + n >= self._prompt_len[r] else []
                for r, n in so.num_scheduled_tokens.items()
            ]
            return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)

        return self._pool.submit(run)

    def shutdown(self) -> None:
        self._pool.shutdown()


def _request(rid: str, max_tokens: int) -> Request:
    return Request(rid, list(range(10, 50)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("blocks_after", [64, 40], ids=["same KV size", "smaller KV size"])
def test_engine_forgets_failed_requests_reconnects_with_backoff_and_serves_again(blocks_after):
    executor = FlakyExecutor(64, blocks_after, refusals=2)
    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=512),
        CacheConfig(block_size=16),
        executor,
    )
    engine = AsyncEngine(core)
    deaths: list[BaseException] = []
    recovered = threading.Event()
    engine.on_death(deaths.append)
    engine.on_recovery(recovered.set)
    try:
        shared = engine.add_request(_request("shared-prefix", 2))
        assert sum(len(c.token_ids) for c in shared) == 2  # leaves cached prefix blocks
        streams = [engine.add_request(_request(f"long-{i}", 10_000)) for i in range(3)]
        for stream in streams:
            next(iter(stream))  # each is running
        executor.fail()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="Socket closed"):
                list(stream)
        assert len(deaths) == 1 and not engine.healthy
        s = engine.get_stats()
        assert (s.num_requests, s.num_running, s.num_waiting) == (0, 0, 0)
        assert s.num_free_blocks == s.num_total_blocks == 63
        with pytest.raises(EngineDeadError):
            engine.add_request(_request("while-down", 2))

        assert recovered.wait(10)
        calls = executor.reinitialize_calls
        assert len(calls) == 3
        # Backoff: 0.5 s, then 1 s between attempts (the engine thread's waits).
        assert calls[1] - calls[0] >= 0.45 and calls[2] - calls[1] >= 0.95
        assert engine.healthy
        s = engine.get_stats()
        assert s.num_total_blocks == blocks_after - 1 and s.num_free_blocks == blocks_after - 1
        # A fresh prefix cache: the new worker holds none of the old KV.
        again = engine.add_request(_request("after", 5))
        chunks = list(again)
        assert sum(len(c.token_ids) for c in chunks) == 5
        assert chunks[0].num_cached_tokens == 0
        s = engine.get_stats()
        assert (s.num_requests, s.num_running, s.num_waiting) == (0, 0, 0)
        core.scheduler.kv_cache_manager.block_pool.check_invariants()
    finally:
        engine.shutdown()


def _lose_worker_and_wait_back(engine: AsyncEngine, executor: FlakyExecutor) -> None:
    recovered = threading.Event()
    engine.on_recovery(recovered.set)
    executor.fail()
    assert recovered.wait(10) and engine.healthy


def test_a_worker_back_with_a_smaller_cache_lowers_max_model_len_and_a_larger_restores_it():
    """max_model_len was given (512): at start-up a cache that cannot hold it is
    refused, but once serving, refusing a smaller worker would turn away every
    request. So max_model_len follows the cache down (19 blocks of 16: 304
    tokens), a long request ends with "length" there instead of failing when
    it outgrows the cache, and a later larger cache brings 512 back."""
    executor = FlakyExecutor(64, 20, refusals=0)
    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=512),
        CacheConfig(block_size=16),
        executor,
        max_model_len_given=True,
    )
    engine = AsyncEngine(core)
    try:
        _lose_worker_and_wait_back(engine, executor)
        assert engine.max_model_len == core.scheduler.scheduler_config.max_model_len == 304
        chunks = list(engine.add_request(_request("long", 10_000)))
        assert chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 304 - 40
        with pytest.raises(ValueError, match="305 tokens, more than max_model_len=304"):
            engine.add_request(Request("too-long", list(range(305)), SamplingParams()))
        core.scheduler.kv_cache_manager.block_pool.check_invariants()

        executor.blocks_after = 64
        _lose_worker_and_wait_back(engine, executor)
        assert engine.max_model_len == core.scheduler.scheduler_config.max_model_len == 512
        chunks = list(engine.add_request(_request("long-again", 10_000)))
        assert chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 512 - 40
    finally:
        engine.shutdown()


def test_a_worker_back_with_no_room_for_one_token_is_retried_not_served():
    executor = FlakyExecutor(64, 1, refusals=0)  # block 0 is reserved: 1 block holds nothing
    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=512),
        CacheConfig(block_size=16),
        executor,
    )
    engine = AsyncEngine(core)
    recovered = threading.Event()
    engine.on_recovery(recovered.set)
    try:
        executor.fail()
        deadline = time.monotonic() + 10
        while len(executor.reinitialize_calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(executor.reinitialize_calls) >= 2  # both connected, both refused
        assert not recovered.is_set() and not engine.healthy
        executor.blocks_after = 64
        assert recovered.wait(10) and engine.healthy
        assert core.scheduler.cache_config.num_blocks == 64 and engine.max_model_len == 512
    finally:
        engine.shutdown()


def test_after_the_engine_dies_for_good_stats_show_no_request_and_every_block_free():
    """A bug (not a lost worker) ends the engine: the requests fail and GetStats
    no longer counts them as running."""
    executor = FlakyExecutor(64, 64, refusals=0)
    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=512),
        CacheConfig(block_size=16),
        executor,
    )
    engine = AsyncEngine(core)
    try:
        streams = [engine.add_request(_request(f"r{i}", 10_000)) for i in range(3)]
        for stream in streams:
            next(iter(stream))
        executor.gone = RuntimeError("a bug in the worker")  # not a ConnectionError
        for stream in streams:
            with pytest.raises(EngineDeadError, match="a bug in the worker"):
                list(stream)
        s = engine.get_stats()
        assert not s.healthy and executor.reinitialize_calls == []
        assert (s.num_requests, s.num_running, s.num_waiting) == (0, 0, 0)
        assert s.num_free_blocks == s.num_total_blocks == 63
    finally:
        engine.shutdown()
