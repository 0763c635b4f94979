"""The collector policy of the engine and worker processes (core/utils/gc_policy.py)."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from tokenbudget.server.entrypoints.cli import main
from tokenbudget.core.utils.gc_policy import DEFAULT_GEN0_THRESHOLD, configure_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_configure_gc_freezes_startup_heap_and_sets_gen0_threshold(restore_gc):
    before = _cycle()
    _, gen1, gen2 = gc.get_threshold()
    policy = configure_gc(1234)
    assert gc.get_threshold() == (1234, gen1, gen2) == policy.thresholds
    # Frozen objects can still die (other threads of the test session free
    # theirs), so the count only shrinks after the call.
    assert 0 < gc.get_freeze_count() <= policy.frozen
    # Frozen objects are out of every generation the collector scans.
    tracked = {id(o) for o in gc.get_objects()}
    assert id(before) not in tracked and id(before.other) not in tracked


def test_cycles_made_after_configure_gc_are_still_collected(restore_gc):
    configure_gc()
    assert gc.get_threshold()[0] == DEFAULT_GEN0_THRESHOLD
    assert gc.isenabled()
    ref = weakref.ref(_cycle())
    gc.collect()
    assert ref() is None


def test_gen0_threshold_below_one_is_refused(restore_gc):
    with pytest.raises(ValueError, match="gen0_threshold must be >= 1, got 0"):
        configure_gc(0)
    with pytest.raises(SystemExit, match="--gc-threshold must be >= 1, got -5"):
        main(["--gc-threshold", "-5"])


def test_worker_initialize_freezes_the_loaded_model_and_sets_gen0_threshold(restore_gc, tiny_model):
    from tokenbudget.core import CacheConfig, SchedulerConfig
    from tokenbudget.proto import convert, worker_pb2
    from tokenbudget.worker.grpc_worker import WorkerServicer

    gc.set_threshold(700, *gc.get_threshold()[1:])
    _, gen1, gen2 = gc.get_threshold()
    request = worker_pb2.InitializeRequest(model=tiny_model, dtype="float32", device="cpu")
    convert.configs_to_proto(
        CacheConfig(block_size=16, num_blocks=32),
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
        request,
    )
    servicer = WorkerServicer(gc_threshold=4321)
    try:
        servicer.Initialize(request, None)
        assert gc.get_threshold() == (4321, gen1, gen2)
        # The model loaded by Initialize is in the permanent generation.
        tracked = {id(o) for o in gc.get_objects()}
        runner = servicer.worker.model_runner
        assert id(runner) not in tracked and id(runner.model) not in tracked
    finally:
        servicer.worker.shutdown()


def test_worker_process_applies_the_gc_policy_once_its_model_is_loaded(cluster):
    # The remote server initialized the worker before it answered SERVING.
    deadline = time.monotonic() + 10
    while (
        not (lines := [x for x in cluster.worker.log if "gc: froze" in x])
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert len(lines) == 1, "".join(cluster.worker.log[-20:])
    frozen = int(lines[0].split("gc: froze ")[1].split()[0])
    assert frozen > 10_000  # torch, transformers and the model, not an empty heap
    assert f"thresholds ({DEFAULT_GEN0_THRESHOLD}, " in lines[0]


def test_worker_gc_threshold_below_one_is_refused():
    from tokenbudget.worker.__main__ import main as worker_main

    with pytest.raises(SystemExit, match="worker: --gc-threshold must be >= 1, got 0"):
        worker_main(["--gc-threshold", "0"])
