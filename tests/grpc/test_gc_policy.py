"""The engine process's collector policy (server/gc_policy.py)."""
from __future__ import annotations

import gc
import weakref

import pytest

from tokenbudget.server.cli import main
from tokenbudget.server.gc_policy import DEFAULT_GEN0_THRESHOLD, configure_gc


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
