"""A remote worker that dies, hangs or is called by a stranger.

The server (``--worker ... --worker-secret-file ... --worker-step-timeout 3``)
fails the requests in flight at once, forgets them (GetStats: nothing
running or waiting, every KV block free), reports NOT_SERVING, reconnects
when the worker is back and then serves the tokens a fresh server serves.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tokenbudget.core import CacheConfig, SchedulerConfig
from tokenbudget.proto import convert, worker_pb2, worker_pb2_grpc
from tokenbudget.server.entrypoints.client import Client

from .conftest import (
    BIN,
    PROBE,
    PROBE_TOKENS,
    STEP_TIMEOUT,
    assert_idle,
    health,
    listening_addresses,
    spawn,
    spawn_worker,
    wait_health,
    wait_idle,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Streams in flight when the fault strikes; each must end with UNAVAILABLE.
NUM_STREAMS = 4
# A restarted worker imports torch and loads the model; the server's backoff
# adds at most 10 s on top.
RECOVERY_BOUND = 25.0


def _start_streams(address: str) -> tuple[list, threading.Barrier]:
    """NUM_STREAMS long greedy streams that each got a first token; their
    outcomes (status, when) land in the returned list."""
    outcomes: list[tuple[object, float, str]] = []
    started = threading.Barrier(NUM_STREAMS + 1)

    def run(i: int) -> None:
        with Client(address) as c:
            stream = c.generate_stream(
                f"stream {i} keeps going", max_tokens=3000, temperature=0, ignore_eos=True
            )
            try:
                next(stream)
                started.wait(60)
                for _ in stream:
                    pass
                outcomes.append(("finished", time.monotonic(), ""))
            except grpc.RpcError as e:
                outcomes.append((e.code(), time.monotonic(), e.details()))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    started.wait(60)
    return outcomes, threads


def _check_failed_fast(outcomes, threads, fault_at: float, bound: float) -> None:
    for t in threads:
        t.join(bound + 10)
    assert len(outcomes) == NUM_STREAMS, outcomes
    assert {code for code, _, _ in outcomes} == {grpc.StatusCode.UNAVAILABLE}, outcomes
    assert max(at for _, at, _ in outcomes) - fault_at < bound, outcomes


def _check_serving_like_a_fresh_server(faults) -> None:
    with Client(faults.remote.address) as c:
        assert_idle(c.stats())
        got = c.generate(PROBE, max_tokens=PROBE_TOKENS, temperature=0, ignore_eos=True)
        assert got.token_ids == faults.reference
        assert_idle(wait_idle(c.stats))


def _init_request(model: str) -> worker_pb2.InitializeRequest:
    request = worker_pb2.InitializeRequest(model=model, dtype="float32", device="cpu")
    convert.configs_to_proto(
        CacheConfig(block_size=16, num_blocks=8), SchedulerConfig(max_model_len=64), request
    )
    return request


# -- the control plane -------------------------------------------------------------------
def test_the_worker_listens_on_loopback_only_by_default(faults):
    # Before the tests below kill it: started without --host.
    assert listening_addresses(faults.worker_port) == {"127.0.0.1"}


@pytest.mark.parametrize(
    "metadata", [(), (("authorization", "Bearer wrong"),)], ids=["no secret", "wrong secret"]
)
def test_worker_refuses_calls_without_the_secret_and_the_server_with_it_works(faults, metadata):
    with grpc.insecure_channel(f"127.0.0.1:{faults.worker_port}") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for call, request in (
            (stub.Shutdown, worker_pb2.ShutdownRequest()),
            (stub.Initialize, _init_request(faults.model)),
            (stub.Health, worker_pb2.HealthRequest()),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(request, metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, call
            assert "--worker-secret-file" in err.value.details()
    assert faults.worker.proc.poll() is None  # Shutdown did not stop it
    # Initialize did not replace the server's model and cache: it still serves them.
    _check_serving_like_a_fresh_server(faults)


def test_a_server_without_the_workers_secret_exits_at_start_in_one_line(faults):
    refused = spawn(
        "server-without-secret",
        [
            str(BIN / "server"),
            "--model",
            faults.model,
            "--port",
            "0",
            "--worker",
            f"127.0.0.1:{faults.worker_port}",
        ],
    )
    assert refused.proc.wait(60) == 1
    errors = [x for x in refused.log if " INFO " not in x and x.strip()]
    assert errors == [
        f"server: worker 127.0.0.1:{faults.worker_port}: initialize failed "
        "(UNAUTHENTICATED: this worker requires the shared secret of "
        "--worker-secret-file (metadata 'authorization: Bearer <secret>'))\n"
    ], refused.log
    assert faults.worker.proc.poll() is None


def test_worker_on_a_public_address_needs_a_secret_or_an_explicit_opt_out():
    refused = spawn(
        "open-worker",
        [sys.executable, "-m", "tokenbudget.worker", "--host", "0.0.0.0", "--port", "0"],
    )
    assert refused.proc.wait(60) == 1
    log = "".join(refused.log)
    assert "refusing to listen on 0.0.0.0 without --worker-secret-file" in log, log
    assert "--allow-unauthenticated" in log
    opted_out = spawn(
        "opted-out-worker",
        [
            sys.executable,
            "-m",
            "tokenbudget.worker",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--allow-unauthenticated",
        ],
    )
    try:
        deadline = time.monotonic() + 60
        while not any("UNAUTHENTICATED worker on 0.0.0.0" in x for x in opted_out.log):
            assert opted_out.proc.poll() is None and time.monotonic() < deadline, opted_out.log
            time.sleep(0.05)
        assert any(" WARNING " in x and "anyone who reaches port" in x for x in opted_out.log)
    finally:
        opted_out.stop()


# -- a worker that dies --------------------------------------------------------------------
def test_killed_worker_fails_streams_fast_and_a_restarted_one_is_served_again(faults):
    outcomes, threads = _start_streams(faults.remote.address)
    killed_at = time.monotonic()
    faults.worker.proc.kill()
    _check_failed_fast(outcomes, threads, killed_at, bound=5.0)
    with Client(faults.remote.address) as c, grpc.insecure_channel(faults.remote.address) as ch:
        assert health(ch) == NOT_SERVING
        assert_idle(c.stats())  # the failed requests are forgotten at once
        with pytest.raises(grpc.RpcError) as err:
            c.generate("while down", max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # A new worker on the same port: the server finds it and serves again.
        faults.worker = spawn_worker(
            "worker-2", faults.worker_port, "--worker-secret-file", str(faults.secret_file)
        ).wait_listening()
        assert wait_health(ch, SERVING, RECOVERY_BOUND) < RECOVERY_BOUND
    _check_serving_like_a_fresh_server(faults)


# -- a worker that hangs -------------------------------------------------------------------
def test_stopped_worker_is_declared_hung_and_serves_again_when_it_continues(faults):
    """Once the worker has answered steps, a hang is found within
    --worker-hang-timeout (3 s here), not the 300 s first-step allowance."""
    outcomes, threads = _start_streams(faults.remote.address)
    stopped_at = time.monotonic()
    faults.worker.proc.send_signal(signal.SIGSTOP)
    try:
        # The watchdog looks every STEP_TIMEOUT / 4 seconds.
        _check_failed_fast(outcomes, threads, stopped_at, bound=STEP_TIMEOUT + 3.0)
        assert all(
            "did not answer a step within --worker-hang-timeout=3 s" in details
            for _, _, details in outcomes
        ), outcomes
        with Client(faults.remote.address) as c, grpc.insecure_channel(faults.remote.address) as ch:
            assert health(ch) == NOT_SERVING
            assert_idle(c.stats())
    finally:
        faults.worker.proc.send_signal(signal.SIGCONT)
    with grpc.insecure_channel(faults.remote.address) as ch:
        assert wait_health(ch, SERVING, RECOVERY_BOUND) < RECOVERY_BOUND
    _check_serving_like_a_fresh_server(faults)
