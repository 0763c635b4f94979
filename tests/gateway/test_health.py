"""SglangScheduler.HealthCheck, which the gateway polls: not healthy while the
server is starting or draining, so the gateway routes elsewhere."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.proto import sglang_scheduler_pb2 as pb
from tokenbudget.proto import sglang_scheduler_pb2_grpc as pb_grpc
from tokenbudget.server.entrypoints.client import Client


def test_health_is_starting_until_ready_then_serving_then_draining(tiny_model):
    from tokenbudget.server.entrypoints.cli import build_engine, build_parser
    from tokenbudget.server.entrypoints.grpc.sglang import add_sglang_scheduler_servicer

    args = build_parser().parse_args(
        ["--model", tiny_model, "--port", "0", "--num-gpu-blocks", "64"]
    )
    engine = build_engine(args)

    async def run() -> list[tuple[bool, str]]:
        server = grpc.aio.server()
        servicer = add_sglang_scheduler_servicer(server, engine)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.SglangSchedulerStub(ch)

                async def check() -> None:
                    r = await stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
                    seen.append((r.healthy, r.message))

                await check()
                servicer.ready = True
                await check()
                servicer.draining = True
                await check()
                # A draining replica refuses work with a status, so the gateway goes elsewhere.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(
                        pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3])),
                        timeout=10,
                    ):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)
        return seen

    try:
        seen = asyncio.run(run())
    finally:
        engine.shutdown()
    assert seen == [
        (False, "starting"),
        (True, "serving"),
        (False, "draining: the server is shutting down"),
    ]


def test_sigterm_makes_health_report_draining_while_requests_finish(cluster):
    drainee = cluster.drainee
    with Client(drainee.address) as c, grpc.insecure_channel(drainee.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
        results: list = []
        params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        t = threading.Thread(target=lambda: results.append(c.generate("drain me", params)))
        t.start()
        deadline = time.monotonic() + 30
        while c.stats().num_requests == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        drainee.proc.terminate()
        deadline = time.monotonic() + 10
        while (r := stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)).healthy:
            assert time.monotonic() < deadline, "still healthy 10 s after SIGTERM"
            time.sleep(0.02)
        assert "draining" in r.message
        assert t.is_alive(), "the request finished before the drain was seen: make it longer"
        t.join(60)
    assert results and results[0].completion_tokens == 1500
    assert drainee.proc.wait(30) == 0
