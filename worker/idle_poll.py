"""Busy polling without a busy loop: idle-priority spinning threads, one per CPU.

Serving one stream on CPU, a decode step takes a millisecond or two and the
threads around it (the engine, the event loop, the gateway, the client) sleep
between short bursts. Each sleep may halt the CPU it ran on. On a virtual
machine a halted vCPU gives its core back to the host, and waking it costs a
trip through the hypervisor and caches that other guests used meanwhile.
vLLM's engine core avoids this by busy-polling its input queue. We get the
same effect without taking time from anyone: a thread per CPU that runs
under ``SCHED_IDLE`` (the kernel lets it run only when nothing else wants
that CPU, and preempts it at once when something does) and spins on a pause
instruction, so the CPU never halts.

Measured on a 2-vCPU AMD EPYC virtual machine, serving the tiny Qwen3 through
the gateway at 4 requests/s (benchmarks/e2e_vs_vllm.py --serve): TPOT p50
about 15 % lower with the spinners than without.

The price: every CPU shows 100 % busy (as vLLM's busy-polling core does),
and on bare metal the CPUs draw more power. Off by default (``server
--busy-poll`` turns it on). The threads live in our C++ extension (built with
the ``cpu`` attention kernel); where it cannot build, ``start`` raises.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _ops():
    from tokenbudget.worker.attention_cpu import _build

    problem = _build()
    if problem is not None:
        raise RuntimeError(f"busy polling needs our C++ extension: {problem}")
    return torch.ops.tokenbudget_cpu


def start(cpus: list[int] | None = None) -> list[int]:
    """Start one idle-priority spinning thread on each of ``cpus`` (default:
    every CPU this process may run on), stopping any started before; returns
    the CPUs. Raises RuntimeError, with no thread left spinning, where a
    thread cannot be pinned to its CPU or given the idle policy."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(set(cpus))
    allowed = os.sched_getaffinity(0)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ValueError(f"CPUs {outside} are not among this process's CPUs {sorted(allowed)}")
    ops = _ops()
    try:
        ops.start_idle_poll(cpus)
    except RuntimeError as exc:
        raise RuntimeError(str(exc).splitlines()[0]) from None
    return cpus


def idle_priority_threads(pid: int | str = "self") -> dict[int, set[int]]:
    """The threads of process ``pid`` running under SCHED_IDLE -> the CPUs
    each may run on (Linux /proc; what ``start`` made, for checks)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[38]) == os.SCHED_IDLE:  # stat's field 41: the policy
                out[int(task.name)] = os.sched_getaffinity(int(task.name))
        except OSError:  # the thread ended meanwhile
            pass
    return out


def stop() -> int:
    """Stop the spinning threads; returns how many there were."""
    return int(_ops().stop_idle_poll())
