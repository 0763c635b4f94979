"""Two tensor-parallel ranks started by hand as on two hosts (``python -m
tokenbudget.worker --rank R --world-size 2 --dist-init tcp://...`` on loopback)
behind a real ``server --worker RANK0``: the same tokens as the in-process
engine; then one rank is killed mid-run: in-flight requests fail with the
reason, the server stays up and reports NOT_SERVING, rank 0 exits instead of
hanging, and once both ranks are restarted the server reconnects and serves
again. The kill test stays last in this file.
"""

from __future__ import annotations

import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenbudget.core import SamplingParams
from tokenbudget.server.entrypoints.client import Client

from .conftest import MAX_NUM_BATCHED_TOKENS, free_port, spawn, spawn_server, wait_serving

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def spawn_ranks(dist_init: str, port: int) -> list:
    rank = [
        sys.executable,
        "-m",
        "tokenbudget.worker",
        "--world-size",
        "2",
        "--dist-init",
        dist_init,
        "--threads",
        "1",
        "--dist-timeout",
        "30",
        "--host",
        "127.0.0.1",
    ]
    return [
        spawn("rank0", [*rank, "--rank", "0", "--port", str(port)]),
        spawn("rank1", [*rank, "--rank", "1"]),
    ]


@pytest.fixture(scope="module")
def tp_cluster(tiny_model):
    dist_init, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    procs = [
        *spawn_ranks(dist_init, port),
        spawn_server(
            "tp-server",
            tiny_model,
            "--worker",
            f"127.0.0.1:{port}",
            "--max-num-batched-tokens",
            str(MAX_NUM_BATCHED_TOKENS),
            "--num-gpu-blocks",
            "512",
        ),
    ]
    try:
        procs[0].wait_listening()
        procs[2].wait_listening()
        wait_serving(procs[2].address)
    except Exception:
        for p in procs:
            p.stop()
        raise
    yield procs, (dist_init, port)
    for p in reversed(procs):
        p.stop()


def test_two_host_group_behind_a_server_generates_what_the_in_process_llm_does(tp_cluster, oracle):
    prompts = [
        "Hello!",
        "Paged attention stores keys and values in fixed-size blocks. " * 3,
        "def fibonacci(n: int) -> int:",
    ]
    want = [r.token_ids for r in oracle.generate(prompts, GREEDY)]
    got: dict[int, list[int]] = {}
    procs, _ = tp_cluster
    with Client(procs[2].address) as c:

        def run(i: int) -> None:
            got[i] = c.generate(prompts[i], GREEDY).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [got[i] for i in range(len(prompts))] == want
    assert "rank 1: loading" in "".join(procs[1].log)  # rank 1 did its share


def test_killing_a_rank_fails_in_flight_requests_and_restarted_ranks_serve_again(
    tp_cluster, oracle
):
    procs, (dist_init, port) = tp_cluster
    rank0, rank1, server = procs
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    with Client(server.address) as c:
        errors: list[tuple[grpc.StatusCode, str, float]] = []
        started = threading.Barrier(4)

        def run() -> None:
            stream = c.generate_stream("keep going", params)
            try:
                next(stream)
                started.wait(30)
                for _ in stream:
                    pass
            except grpc.RpcError as e:
                errors.append((e.code(), e.details(), time.monotonic()))

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait(60)
        killed_at = time.monotonic()
        rank1.proc.kill()
        for t in threads:
            t.join(15)
        assert len(errors) == 3, errors
        assert all(code == grpc.StatusCode.UNAVAILABLE for code, _, _ in errors)
        assert all("tensor-parallel group broken" in details for _, details, _ in errors), errors
        assert max(at for _, _, at in errors) - killed_at < 10.0
        health = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            c.generate("after", GREEDY)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # Rank 0 left the broken group and exited (status 1); the server stays up.
    assert rank0.proc.wait(15) == 1
    assert server.proc.poll() is None
    # The ranks restarted as before (by hand, or a supervisor): the server,
    # reconnecting with backoff, serves again.
    procs[:2] = spawn_ranks(dist_init, port)
    wait_serving(server.address, timeout=120)
    with Client(server.address) as c:
        assert (
            c.generate("Hello!", GREEDY).token_ids
            == oracle.generate(["Hello!"], GREEDY)[0].token_ids
        )
