"""A full waiting queue answers RESOURCE_EXHAUSTED and the server keeps serving."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import Future

import grpc
import pytest

from tokenbudget.core import CacheConfig, ModelRunnerOutput, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.server.engine.async_engine import AsyncEngine


class SlowExecutor:
    """Every step takes 20 ms; one token per request whose prompt is done."""

    def __init__(self) -> None:
        self._pool = futures.ThreadPoolExecutor(1)
        self._prompt_len: dict[str, int] = {}

    def initialize(self, cache_config, scheduler_config) -> int:
        return 64

    def execute_model(self, so) -> Future:
        for r in so.scheduled_new_reqs:
            self._prompt_len[r.req_id] = len(r.prompt_token_ids)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(
            zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens)
        )

        def run() -> ModelRunnerOutput:
            time.sleep(0.02)
            ids = list(so.num_scheduled_tokens)
            sampled = [
                [7] if computed[r] + n >= self._prompt_len[r] else []
                for r, n in so.num_scheduled_tokens.items()
            ]
            return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)

        return self._pool.submit(run)

    def shutdown(self) -> None:
        self._pool.shutdown()


@pytest.fixture(params=["fcfs"])
def slow_server(request, tmp_path, serving):
    from tokenbudget.server.engine.input_processor import InputProcessor
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    path = build_tiny_qwen3(tmp_path / "m")
    executor = SlowExecutor()
    core = EngineCore(
        SchedulerConfig(
            max_num_seqs=1, max_queued_requests=1, max_model_len=256, policy=request.param
        ),
        CacheConfig(block_size=16),
        executor,
    )
    engine = AsyncEngine(core, InputProcessor.from_pretrained(path), model_name="tiny")
    with serving(engine) as client:
        yield client, engine


def test_request_beyond_max_queued_requests_is_resource_exhausted(slow_server):
    client, engine = slow_server
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ids = {"prompt_token_ids": [5, 6, 7]}
    pool = futures.ThreadPoolExecutor(2)
    running = pool.submit(client.generate, ids, long, request_id="running")
    sched = engine.core.scheduler
    # Wait until "running" holds the only seat, then fill the queue.
    _wait_until(lambda: len(sched.running) == 1 or running.done())
    assert not running.done(), running.exception()
    queued = pool.submit(client.generate, ids, params, request_id="queued")
    _wait_until(lambda: len(sched.waiting) == 1)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(ids, params, request_id="one-too-many")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_requests=1" in err.value.details()
    client.abort("running")
    assert running.result(timeout=30).finish_reason == "abort"
    assert len(queued.result(timeout=30).token_ids) == 2
    # The server still serves.
    assert len(client.generate(ids, params, request_id="after").token_ids) == 2


@pytest.mark.parametrize("slow_server", ["priority"], indirect=True)
def test_a_queued_request_evicted_by_a_higher_priority_one_is_told_why(slow_server):
    client, engine = slow_server
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ids = {"prompt_token_ids": [5, 6, 7]}
    pool = futures.ThreadPoolExecutor(3)
    running = pool.submit(client.generate, ids, long, request_id="running")
    sched = engine.core.scheduler
    _wait_until(lambda: len(sched.running) == 1 or running.done())
    low = pool.submit(client.generate, ids, params, request_id="low", priority=5)
    _wait_until(lambda: len(sched.waiting) == 1)
    high = pool.submit(client.generate, ids, params, request_id="high", priority=1)
    with pytest.raises(grpc.RpcError) as err:
        low.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == (
        "evicted from the full waiting queue (max_queued_requests=1) "
        "by a higher-priority request; retry later"
    )
    client.abort("running")
    assert len(high.result(timeout=30).token_ids) == 2
    _wait_until(lambda: not sched.requests)
    sched.kv_cache_manager.block_pool.check_invariants()


def _wait_until(condition, timeout: float = 10.0) -> None:
    stop = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        stop.wait(0.02)
    raise AssertionError("condition not reached")
