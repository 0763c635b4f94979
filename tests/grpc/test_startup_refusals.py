"""Settings that cannot work are refused at start-up: one line on stderr,
exit status 2, no traceback (issue 10, defects 1 and 4)."""

from __future__ import annotations

import sys
import time

import pytest

from tokenbudget.server.entrypoints import cli

from .conftest import BIN, free_port, spawn


def test_server_refuses_a_kv_cache_that_cannot_hold_max_model_len(tiny_model):
    # build_engine's ValueError is main's one-line exit 2 (tests/grpc/test_load_errors.py).
    args = cli.build_parser().parse_args(
        [
            "--model",
            tiny_model,
            "--num-gpu-blocks",
            "4",
            "--max-model-len",
            "2048",
            "--device",
            "cpu",
            "--port",
            "0",
        ]
    )
    with pytest.raises(ValueError) as err:
        cli.build_engine(args)
    assert str(err.value) == (
        "num_gpu_blocks=4 (--num-gpu-blocks) gives 48 tokens of KV cache (3 blocks of 16), "
        "less than max_model_len=2048 needs (2048); raise the KV cache (--num-gpu-blocks / "
        "--kv-cache-memory / --gpu-memory-utilization) or lower max_model_len "
        "(--max-model-len)"
    )


def test_server_refuses_xxhash_without_the_package_before_loading(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", "/no/such/model", "--hash-algo", "xxhash"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "server: hash_algo='xxhash' needs the xxhash package, which is not "
        "installed: pip install 'tokenbudget[fast-hash]', or use "
        "hash_algo='sha256'\n"
    )


def test_server_gives_up_on_a_worker_nobody_listens_on_after_worker_connect_timeout(tiny_model):
    """Without the flag the wait was gRPC's 120 s; with it the server exits
    within it (plus start-up) with one line naming the address and the flag."""
    port = free_port()  # bound, then closed: nothing listens there
    server = spawn(
        "server-no-worker",
        [
            str(BIN / "server"),
            "--model",
            tiny_model,
            "--port",
            "0",
            "--worker",
            f"127.0.0.1:{port}",
            "--worker-connect-timeout",
            "2",
        ],
    )
    try:
        deadline = time.monotonic() + 120
        while not any("driving remote workers" in line for line in server.log):
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log
            time.sleep(0.05)
        connecting = time.monotonic()  # the executor is being built from here on
        assert server.proc.wait(30) == 1
        assert time.monotonic() - connecting < 2 + 10, server.log
    finally:
        server.stop()
    errors = [x for x in server.log if " INFO " not in x and x.strip()]
    assert errors == [
        f"server: worker 127.0.0.1:{port}: initialize failed (nothing accepted "
        "the connection within --worker-connect-timeout=2 s)\n"
    ], server.log
