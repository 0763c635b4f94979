"""worker/idle_poll.py: one SCHED_IDLE spinning thread per CPU, pinned to it,
that leaves a normal thread its CPU and stops when asked."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tokenbudget.worker import idle_poll

idle_threads = idle_poll.idle_priority_threads


def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


@pytest.fixture
def stopped():
    yield
    idle_poll.stop()
    assert wait_for(lambda: not idle_threads()), "spinning threads outlived stop()"


def test_one_pinned_idle_priority_thread_per_cpu_until_stopped(stopped):
    assert idle_threads() == {}
    cpus = idle_poll.start()
    assert cpus == sorted(os.sched_getaffinity(0))
    spinners = wait_for(lambda: t if len(t := idle_threads()) == len(cpus) else None)
    assert spinners is not None, idle_threads()
    assert sorted(next(iter(a)) for a in spinners.values()) == cpus
    assert all(len(a) == 1 for a in spinners.values())
    # The process's own threads keep the normal policy and all its CPUs.
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert os.sched_getaffinity(0) == set(cpus)

    assert idle_poll.stop() == len(cpus)
    assert wait_for(lambda: not idle_threads()), idle_threads()


def test_a_second_start_replaces_the_first_set(stopped):
    cpu = min(os.sched_getaffinity(0))
    idle_poll.start([cpu])
    idle_poll.start([cpu])
    assert wait_for(lambda: len(idle_threads()) == 1 or None), idle_threads()
    time.sleep(0.1)  # the first set's thread has had time to exit
    assert len(idle_threads()) == 1
    assert idle_poll.stop() == 1


def test_a_cpu_this_process_may_not_use_is_refused(stopped):
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"CPUs \[{outside}\] are not among"):
        idle_poll.start([outside])
    assert idle_threads() == {}


def _cpu_share(cpu: int, seconds: float = 0.3) -> float:
    """CPU time / wall time of a busy thread pinned to ``cpu``."""
    share = []

    def busy() -> None:
        os.sched_setaffinity(0, {cpu})
        wall, cpu_time = time.perf_counter(), time.thread_time()
        while time.perf_counter() - wall < seconds:
            pass
        share.append((time.thread_time() - cpu_time) / (time.perf_counter() - wall))

    t = threading.Thread(target=busy)
    t.start()
    t.join()
    return share[0]


def test_a_spinner_leaves_a_normal_thread_its_cpu(stopped):
    # A spinner at normal priority would take about half the CPU from the
    # busy thread; at idle priority it takes almost nothing.
    cpu = min(os.sched_getaffinity(0))
    alone = _cpu_share(cpu)
    idle_poll.start([cpu])
    assert wait_for(lambda: idle_threads() or None)
    # Best of three: another process on a busy CI box may take a slice of one try.
    shared = max(_cpu_share(cpu) for _ in range(3))
    assert shared > 0.85 * alone, (shared, alone)
