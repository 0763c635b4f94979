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
