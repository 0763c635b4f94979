"""A `server --worker` driving `python -m tokenbudget.worker` over gRPC.

The last test kills the worker, so it stays last in this file; no other file
uses the remote server.
"""
from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenbudget.core import SamplingParams
from tokenbudget.server.client import Client

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_remote_worker_server_generates_what_the_in_process_llm_does(cluster, oracle):
    # Mixed lengths, one chunked prompt, run concurrently so steps batch them.
    prompts = ["Hello!", "Paged attention stores keys and values in fixed-size blocks. " * 3,
               "def fibonacci(n: int) -> int:", "東京 こんにちは"]
    want = [r.token_ids for r in oracle.generate(prompts, GREEDY)]
    got: dict[int, list[int]] = {}
    with Client(cluster.remote.address) as c:
        assert c.model_info().num_workers == 1 and c.model_info().async_scheduling

        def run(i: int) -> None:
            got[i] = c.generate(prompts[i], GREEDY).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [got[i] for i in range(len(prompts))] == want
        s = c.stats()
        assert s.num_requests == 0 and s.num_free_blocks == s.num_total_blocks


def test_killing_the_worker_fails_in_flight_requests_unavailable_and_server_stays_up(cluster):
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    with Client(cluster.remote.address) as c:
        errors: list[tuple[grpc.StatusCode, float]] = []
        started = threading.Barrier(5)

        def run() -> None:
            stream = c.generate_stream("keep going", params)
            try:
                next(stream)
                started.wait(30)
                for _ in stream:
                    pass
            except grpc.RpcError as e:
                errors.append((e.code(), time.monotonic()))

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(60)
        killed_at = time.monotonic()
        cluster.worker.proc.kill()
        for t in threads:
            t.join(10)
        assert len(errors) == 4
        assert all(code == grpc.StatusCode.UNAVAILABLE for code, _ in errors)
        assert max(at for _, at in errors) - killed_at < 5.0
        health = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # Still up and answering: new work is refused cleanly, info still served.
        try:
            c.generate("after", GREEDY)
            raise AssertionError("a dead engine accepted a request")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
        assert c.model_info().num_workers == 1
        assert cluster.remote.proc.poll() is None
