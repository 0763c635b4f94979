"""EngineCore: the sync loop and the async (overlapped) loop produce the same
tokens, through chunked prefill and preemption."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbudget.core import CacheConfig, ModelRunnerOutput, SchedulerConfig, SchedulerOutput
from tokenbudget.server.engine.core import EngineCore

VOCAB = 50
EOS = 3


class FakeExecutor:
    """A worker that knows only what SchedulerOutputs tell it. It keeps each
    request's tokens itself (so with async scheduling it feeds its own last
    sampled token) and samples a hash of the token history once a request's
    prefill is complete. ``threaded`` answers with Futures from a thread."""

    def __init__(self, num_blocks: int, token_fn, threaded: bool) -> None:
        self.num_blocks = num_blocks
        self.token_fn = token_fn
        self.tokens: dict[str, list[int]] = {}
        self.pool = ThreadPoolExecutor(1) if threaded else None
        self.num_steps = 0

    def initialize(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> int:
        return self.num_blocks

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self.pool is not None:
            return self.pool.submit(self._run, so)
        fut: Future[ModelRunnerOutput] = Future()
        fut.set_result(self._run(so))
        return fut

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            if rid in cached.resumed_token_ids:
                self.tokens[rid] = list(cached.resumed_token_ids[rid])
            computed[rid] = n
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            history = self.tokens[rid]
            assert computed[rid] + so.num_scheduled_tokens[rid] <= len(history)
            if computed[rid] + so.num_scheduled_tokens[rid] == len(history):
                history.append(self.token_fn(history, VOCAB))
                sampled.append([history[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


DEFAULT_SPECS = [(f"r{i}", 5 + 9 * i % 55, 5 + 7 * i % 21) for i in range(10)]


def _run_engine(
    make_request,
    history_token,
    *,
    async_scheduling: bool,
    threaded: bool,
    max_steps: int = 2000,
    specs=DEFAULT_SPECS,
    recorder=None,
    **config,
):
    """Run ``specs`` to the end: (tokens, finish reasons, stats, the number of
    steps sent before the previous step's result was applied; None without
    ``recorder``, the conftest's OverlapRecorder)."""
    num_blocks = config.pop("num_blocks", 1000)
    cache_cfg = CacheConfig(
        block_size=config.pop("block_size", 4),
        enable_prefix_caching=config.pop("enable_prefix_caching", True),
    )
    sched_cfg = SchedulerConfig(async_scheduling=async_scheduling, **config)
    executor = FakeExecutor(num_blocks, history_token, threaded)
    if recorder is not None:
        executor = recorder(executor)
    engine = EngineCore(sched_cfg, cache_cfg, executor)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}

    def add(rid, prompt, max_tokens):
        engine.add_request(
            make_request(
                rid,
                prompt,
                max_tokens=max_tokens,
                eos=EOS,
                stop_token_ids=[11] if rid == "r3" else [],
            )
        )

    half = len(specs) // 2
    for spec in specs[:half]:
        add(*spec)
    for n in range(max_steps):
        if n == 5:  # the second half arrives while the first is running
            for spec in specs[half:]:
                add(*spec)
        elif n > 5 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError(f"engine did not finish in {max_steps} steps")
    engine.shutdown()
    pool = engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    overlaps = executor.num_overlapped_steps if recorder is not None else None
    return tokens, reasons, engine.scheduler.make_stats(), overlaps


PRESSURE = dict(block_size=4, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.mark.parametrize("threaded", [False, True])
def test_async_scheduling_overlaps_steps_and_produces_the_tokens_of_sync_scheduling(
    make_request, history_token, overlap_recorder, threaded
):
    sync_tokens, sync_reasons, sync_stats, sync_overlaps = _run_engine(
        make_request,
        history_token,
        async_scheduling=False,
        threaded=False,
        recorder=overlap_recorder,
        **PRESSURE,
    )
    async_tokens, async_reasons, async_stats, async_overlaps = _run_engine(
        make_request,
        history_token,
        async_scheduling=True,
        threaded=threaded,
        recorder=overlap_recorder,
        **PRESSURE,
    )

    # The overlap itself: async sends step N+1 before applying step N's result.
    assert sync_overlaps == 0
    assert async_overlaps > len(sync_tokens)

    assert sync_stats.num_preemptions > 0 and async_stats.num_preemptions > 0
    assert async_tokens == sync_tokens
    assert async_reasons == sync_reasons
    assert len(sync_reasons) == len(DEFAULT_SPECS)
    # The oracle: an unpressured, unchunked sync run.
    free_tokens, free_reasons, free_stats, _ = _run_engine(
        make_request, history_token, async_scheduling=False, threaded=False
    )
    assert free_stats.num_preemptions == 0
    assert (free_tokens, free_reasons) == (sync_tokens, sync_reasons)


def test_async_engine_finishes_when_running_requests_wait_for_their_last_token(
    make_request, history_token
):
    # With one seat, the waiting request can only start once the running one's
    # last token (in flight) has come back.
    engine = EngineCore(
        SchedulerConfig(max_num_seqs=1, async_scheduling=True),
        CacheConfig(block_size=4),
        FakeExecutor(100, history_token, True),
    )
    engine.add_request(make_request("a", 6, max_tokens=1))
    engine.add_request(make_request("b", 6, max_tokens=1))
    finished = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        finished += [o.request_id for o in engine.step() if o.finished]
    engine.shutdown()
    assert finished == ["a", "b"]


def test_engine_tells_workers_about_an_abort_even_with_nothing_left_to_run(
    make_request, history_token
):
    for async_scheduling in (False, True):
        executor = FakeExecutor(100, history_token, False)
        engine = EngineCore(
            SchedulerConfig(async_scheduling=async_scheduling), CacheConfig(block_size=4), executor
        )
        engine.add_request(make_request("a", 6, max_tokens=50))
        engine.step()
        engine.step()
        assert "a" in executor.tokens
        engine.abort_requests(["a"])
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()
        assert "a" not in executor.tokens, f"async_scheduling={async_scheduling}"


# The fixtures hand out plain functions: sharing them across examples is safe.
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    block_size=st.sampled_from([1, 4, 16]),
    extra_blocks=st.integers(0, 20),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 5),
    threshold=st.sampled_from([0, 0, 7]),
    caching=st.booleans(),
    specs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20)), min_size=1, max_size=8),
)
def test_async_matches_sync_on_random_workloads(
    make_request,
    history_token,
    overlap_recorder,
    block_size,
    extra_blocks,
    budget,
    max_num_seqs,
    threshold,
    caching,
    specs,
):
    specs = [(f"r{i}", prompt, max_tokens) for i, (prompt, max_tokens) in enumerate(specs)]
    # Room for the longest request alone, so every request can finish.
    longest = max(prompt + max_tokens for _, prompt, max_tokens in specs)
    config = dict(
        block_size=block_size,
        num_blocks=1 + -(-longest // block_size) + extra_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=caching,
    )
    sync = _run_engine(
        make_request,
        history_token,
        async_scheduling=False,
        threaded=False,
        specs=specs,
        recorder=overlap_recorder,
        **config,
    )
    async_ = _run_engine(
        make_request,
        history_token,
        async_scheduling=True,
        threaded=False,
        specs=specs,
        recorder=overlap_recorder,
        **config,
    )
    assert async_[:2] == sync[:2]
    assert sync[3] == 0
