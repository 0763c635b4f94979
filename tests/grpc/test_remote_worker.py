"""A `server --worker` driving `python -m tokenbudget.worker` over gRPC.

The last test kills the worker, so it stays last in this file; no other file
uses the remote server.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenbudget.core import SamplingParams
from tokenbudget.server.entrypoints.client import Client

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_remote_worker_server_generates_what_the_in_process_llm_does(cluster, oracle):
    # Mixed lengths, one chunked prompt, run concurrently so steps batch them.
    prompts = [
        "Hello!",
        "Paged attention stores keys and values in fixed-size blocks. " * 3,
        "def fibonacci(n: int) -> int:",
        "東京 こんにちは",
    ]
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


# Samples and prompt logprobs cross the worker protocol (the remote server) as
# they cross the in-process executor (the local one).
PROMPT = list(range(40, 90))  # 50 tokens: a chunked prefill at the servers' budget of 64


@pytest.mark.parametrize("server", ["local", "remote"])
def test_n_samples_stream_with_their_index_and_equal_the_llm(cluster, oracle, server):
    params = SamplingParams(
        n=3, seed=5, temperature=1.0, max_tokens=10, ignore_eos=True, logprobs=1
    )
    want = oracle.generate({"prompt_token_ids": PROMPT}, params)[0]
    with Client(getattr(cluster, server).address) as c:
        got = c.generate(PROMPT, params)
    assert [s.index for s in got.samples] == [0, 1, 2]
    assert [s.token_ids for s in got.samples] == [o.token_ids for o in want.outputs]
    assert [s.text for s in got.samples] == [o.text for o in want.outputs]
    assert all(s.finish_reason == "length" and s.completion_tokens == 10 for s in got.samples)
    for s, o in zip(got.samples, want.outputs):
        assert [lp.keys() for lp in s.logprobs] == [lp.keys() for lp in o.logprobs]


@pytest.mark.parametrize("server", ["local", "remote"])
def test_prompt_logprobs_over_grpc_equal_the_llm(cluster, oracle, server):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3)
    want = oracle.generate({"prompt_token_ids": PROMPT}, params)[0]
    with Client(getattr(cluster, server).address) as c:
        got = c.generate(PROMPT, params)
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(PROMPT)
    for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) < 1e-4 for t in g)
    assert got.token_ids == want.token_ids


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
