"""A real `server` driving a real worker process whose step fails for one
request: that stream alone ends with INTERNAL, the concurrent streams finish
with the tokens they get without it, and the server keeps serving with no
request or KV block left behind (tests/grpc/faulty_worker.py injects the fault).
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenbudget.core import SamplingParams
from tokenbudget.server.entrypoints.client import Client

FAULT_SEED = 2989  # faulty_worker.FAULT_SEED
PROMPTS = [list(range(40 + 9 * i, 70 + 9 * i)) for i in range(3)]
GOOD = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
]
BAD = SamplingParams(max_tokens=24, temperature=1.0, seed=FAULT_SEED, ignore_eos=True)


def test_one_failing_stream_leaves_the_others_and_the_server_serving(faulty_remote):
    with Client(faulty_remote.address) as c:
        want = [c.generate(p, s).token_ids for p, s in zip(PROMPTS, GOOD)]
        got: dict[int, list[int]] = {}
        started = [threading.Event() for _ in PROMPTS]

        def run(i: int) -> None:
            tokens = got[i] = []
            for msg in c.generate_stream(PROMPTS[i], GOOD[i]):
                tokens.extend(msg.token_ids)
                started[i].set()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        # The bad request joins steps in which the others decode.
        try:
            c.generate([5, 6, 7, 8], BAD)
            raise AssertionError("the faulty request finished normally")
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        for t in threads:
            t.join(60)
        assert code == grpc.StatusCode.INTERNAL
        assert "injected fault" in details and ".py" not in details
        assert "Traceback" not in details
        assert [got[i] for i in range(len(PROMPTS))] == want
        # Still serving, nothing left behind.
        stub = health_pb2_grpc.HealthStub(c.channel)
        assert (
            stub.Check(health_pb2.HealthCheckRequest()).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        s = c.stats()
        assert s.num_requests == 0 and s.num_running == 0
        assert s.num_free_blocks == s.num_total_blocks
        assert c.generate(PROMPTS[0], GOOD[0]).token_ids == want[0]
