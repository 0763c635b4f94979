"""How many CPUs this process may use: the default of torch's intra-op threads."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: what taskset,
    cgroup cpusets and container limits leave it), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return os.cpu_count() or 1


def server_compute_threads() -> int:
    """torch intra-op threads for a server by default: the available CPUs but
    one, left to what runs beside the model (the gRPC event loop, the engine
    and detokenizer threads, a gateway on the same host), at least 1. A model
    thread that must share its core with those waits at every parallel op:
    on 2 CPUs, serving TPOT was 1.6-1.9x with 2 threads vs 1. vLLM's CPU
    backend reserves one CPU the same way (VLLM_CPU_NUM_OF_RESERVED_CPU)."""
    return max(1, available_cpus() - 1)
