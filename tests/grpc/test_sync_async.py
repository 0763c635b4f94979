"""The overlap (async) loop and the plain loop give identical tokens, in
process and over a gRPC worker, with chunking and a forced preemption."""

from __future__ import annotations

import random

import pytest

from tokenbudget.core import CacheConfig, Request, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore

# 12 usable blocks of 8 tokens for 6 requests of up to 40 + 24 tokens: the
# running batch outgrows the cache and preemption must happen.
BLOCK_SIZE, NUM_BLOCKS, BUDGET = 8, 13, 24


def _workload() -> list[Request]:
    rng = random.Random(1)
    reqs = []
    for i, (n, m) in enumerate([(5, 20), (40, 8), (17, 24), (3, 1), (29, 16), (9, 12)]):
        ids = [rng.randrange(3, 1000) for _ in range(n)]
        reqs.append(
            Request(f"r{i}", ids, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        )
    return reqs


def _run(executor, async_scheduling: bool) -> tuple[dict[str, list[int]], int]:
    """The workload's tokens and the number of preemptions. ``executor`` may
    be an OverlapRecorder, which then holds the order of steps."""
    sched = SchedulerConfig(
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        max_model_len=128,
        async_scheduling=async_scheduling,
    )
    core = EngineCore(sched, CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS), executor)
    try:
        for r in _workload():
            core.add_request(r)
        out: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        stats = core.scheduler.make_stats()
        pool = core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
        return out, stats.num_preemptions
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker

    tokens, preemptions = _run(InProcessExecutor(Worker(tiny_model, device="cpu")), False)
    assert preemptions > 0, "the workload must force a preemption"
    assert {len(v) for v in tokens.values()} == {20, 8, 24, 1, 16, 12}
    return tokens


def test_async_in_process_loop_overlaps_steps_and_gives_the_sync_tokens(
    tiny_model, reference, overlap_recorder
):
    import threading

    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker

    worker = Worker(tiny_model, device="cpu")
    forward_threads = set()
    run_step = worker.execute_model

    def execute_model(so):
        forward_threads.add(threading.get_ident())
        return run_step(so)

    executor = overlap_recorder(InProcessExecutor(worker, async_mode=True))
    worker.execute_model = executor.hold_until_next_sent(execute_model)
    assert _run(executor, True)[0] == reference
    # Step N+1 was sent before step N's result was applied, and the forwards
    # ran on the executor's thread, not the engine's.
    assert executor.num_overlapped_steps > len(reference)
    assert threading.get_ident() not in forward_threads
    # And the worker saw it: while it held step N, the engine sent step N+1.
    # (An executor whose execute_model waits for its step passes the two
    # checks above, since the recorder sees "send" before "apply"; not this.)
    assert len(executor.worker_overlapped) > len(reference)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_remote_worker_loops_give_the_in_process_sync_tokens_and_async_overlaps(
    tiny_model, reference, overlap_recorder, async_scheduling
):
    from tokenbudget.worker.grpc_worker import serve
    from tokenbudget.server.executor.remote import RemoteExecutor

    from tokenbudget.worker.worker import Worker

    recorder: list = []

    def held_worker(model, dtype, device, attention_backend, **options):
        # The worker (in this process, behind a real gRPC server) holds each
        # step until the engine has sent another: it sees the overlap itself.
        worker = Worker(
            model,
            dtype=dtype,
            device=device or None,
            attention_backend=attention_backend,
            **options,
        )
        worker.execute_model = recorder[0].hold_until_another_sent(worker.execute_model)
        return worker

    server, port, _ = serve("127.0.0.1", 0, worker_factory=held_worker)
    try:
        executor = overlap_recorder(RemoteExecutor([f"127.0.0.1:{port}"], tiny_model, device="cpu"))
        recorder.append(executor)
        assert _run(executor, async_scheduling)[0] == reference
    finally:
        server.stop(0)
    if async_scheduling:  # step N+1 went down the stream before step N's reply was applied
        assert executor.num_overlapped_steps > len(reference)
        # (a RemoteExecutor.execute_model that waits for its reply passes the
        # check above, the recorder seeing "send" before "apply"; not this one)
        assert len(executor.worker_overlapped) > len(reference)
    else:
        assert executor.num_overlapped_steps == 0
        assert not executor.worker_overlapped


def test_two_remote_workers_run_every_step_in_lockstep_and_give_the_sync_tokens(
    tiny_model, reference, overlap_recorder, monkeypatch
):
    from tokenbudget.worker.grpc_worker import serve
    from tokenbudget.server.executor.remote import RemoteExecutor
    from tokenbudget.worker.worker import Worker

    steps_run: dict[int, int] = {}  # worker (by id) -> steps it executed
    run_step = Worker.execute_model

    def execute_model(self, so):
        steps_run[id(self)] = steps_run.get(id(self), 0) + 1
        return run_step(self, so)

    monkeypatch.setattr(Worker, "execute_model", execute_model)
    servers = [serve("127.0.0.1", 0) for _ in range(2)]
    try:
        executor = overlap_recorder(
            RemoteExecutor(
                [f"127.0.0.1:{port}" for _, port, _ in servers], tiny_model, device="cpu"
            )
        )
        assert _run(executor, True)[0] == reference
    finally:
        for server, _, _ in servers:
            server.stop(0)
    num_sent = sum(1 for kind, _ in executor.events if kind == "send")
    assert list(steps_run.values()) == [num_sent, num_sent]
    assert executor.num_overlapped_steps > len(reference)
