"""torch's default intra-op threads (server --torch-threads 0, python -m
tokenbudget.worker --threads 0) follow the CPUs the process may run on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenbudget.core.utils.cpus import available_cpus


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity API")
def test_available_cpus_follows_the_affinity_mask_not_the_machine():
    one = min(os.sched_getaffinity(0))
    code = (
        "import os; from tokenbudget.core.utils.cpus import available_cpus; "
        f"os.sched_setaffinity(0, {{{one}}}); print(available_cpus())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    assert available_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity API")
@pytest.mark.parametrize("num_cpus", [1, 2])
def test_a_server_leaves_one_available_cpu_to_serving_but_keeps_one_for_the_model(num_cpus):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < num_cpus:
        pytest.skip(f"needs {num_cpus} CPUs")
    code = (
        "import os; from tokenbudget.core.utils.cpus import server_compute_threads; "
        f"os.sched_setaffinity(0, {set(cpus[:num_cpus])}); print(server_compute_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(max(1, num_cpus - 1))


def test_a_server_on_many_cpus_leaves_exactly_one(monkeypatch):
    from tokenbudget.core.utils import cpus

    monkeypatch.setattr(cpus, "available_cpus", lambda: 8)
    assert cpus.server_compute_threads() == 7
