"""The KV transfer tests (test_kv_transfer_nixl.py, test_kv_transfer_mooncake.py)
each in a pytest process of its own. NIXL's and Mooncake's bundled native
libraries abort a process that has loaded a conflicting copy of theirs
(grpc_tools' protoc, the other transfer library), and a test suite loads
whatever its other tests need; a fresh process loads only its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_the_transfer_tests_pass_in_their_own_process(backend):
    env = dict(os.environ, TOKENBUDGET_TRANSFER_TESTS=backend)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(HERE / f"test_kv_transfer_{backend}.py")],
        cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = run.stdout + run.stderr
    if run.returncode == 5 or (run.returncode == 0 and " passed" not in out):
        pytest.skip(f"{backend} is not usable here: {out.strip().splitlines()[-1]}")
    assert run.returncode == 0, out[-6000:]
