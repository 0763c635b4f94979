"""Refused requests free their payload at once (issue 10, defect 10), and what
a client is told holds no internal paths (item 12)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import weakref

import grpc
import pytest

from tokenbudget.server.entrypoints.grpc.limits import RefusedBytes
from tokenbudget.proto import generate_pb2
from tokenbudget.server.entrypoints.grpc.errors import public_message, undecodable

PAYLOAD = 2 << 20


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path):
    from tokenbudget.core.config import CacheConfig, SchedulerConfig
    from tokenbudget.server.engine.core import EngineCore
    from tokenbudget.server.engine.async_engine import AsyncEngine
    from tokenbudget.server.engine.input_processor import InputProcessor
    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker

    core = EngineCore(
        SchedulerConfig(max_model_len=64),
        CacheConfig(num_blocks=16),
        InProcessExecutor(Worker(tiny_qwen3_path), async_mode=True),
    )
    engine = AsyncEngine(core, InputProcessor.from_pretrained(tiny_qwen3_path), model_name="t")
    yield engine
    engine.shutdown()


async def _refuse_many(engine, requests: list[generate_pb2.GenerateRequest]) -> list[int]:
    """Send each request to a grpc.aio server hosting ``engine``; the traced
    memory after each refusal (the collector disabled throughout)."""
    from tokenbudget.server.entrypoints.grpc.generation import add_generation_servicer

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    add_generation_servicer(server, engine)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    after: list[int] = []
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 16 << 20)]
        ) as channel:
            call = channel.unary_stream(
                "/tokenbudget.v1.Generation/Generate",
                request_serializer=generate_pb2.GenerateRequest.SerializeToString,
                response_deserializer=generate_pb2.GenerateResponse.FromString,
            )
            for request in requests:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call(request):
                        pass
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (
                    "max_prompt_bytes" in info.value.details()
                    or "temperature" in info.value.details()
                )
                after.append(tracemalloc.get_traced_memory()[0])
    finally:
        await server.stop(0)
    return after


def test_refused_large_prompts_are_freed_without_a_collection(engine):
    # Two kinds of refusal: before the prompt is read (a bad sampling field)
    # and after it was (longer than max_prompt_bytes).
    requests = []
    for i in range(12):
        request = generate_pb2.GenerateRequest(text=f"{i} " + "x" * PAYLOAD)
        if i % 2:
            request.sampling_params.temperature = -1
        requests.append(request)
    gc.disable()
    tracemalloc.start()
    try:
        after = asyncio.run(_refuse_many(engine, requests))
    finally:
        tracemalloc.stop()
        gc.enable()
    # The first refusals warm up grpc and the tokenizer; after them each
    # refusal must leave nothing of its 2 MB behind.
    growth = after[-1] - after[3]
    assert growth < PAYLOAD, f"{growth / 2**20:.1f} MiB kept by 8 refused 2 MiB prompts"


def test_refused_bytes_collect_garbage_once_they_add_up():
    class Payload:
        pass

    def cycle() -> weakref.ref:
        a, b = Payload(), Payload()
        a.other, b.other = b, a
        return weakref.ref(a)

    counter = RefusedBytes(per_collection=100)
    gc.disable()
    try:
        ref = cycle()
        counter.add(60)
        assert ref() is not None and counter.collections == 0
        counter.add(60)
        assert ref() is None and counter.collections == 1
    finally:
        gc.enable()


def test_public_messages_hold_no_paths_or_tracebacks():
    worker_error = (
        "the engine stopped: worker 127.0.0.1:5 failed: Traceback (most recent "
        'call last):\n  File "/home/u/venv/lib/python3.11/site-packages/tokenbudget/'
        'worker/model_runner.py", line 412, in execute\n    logits = self.model(x)'
        "\nRuntimeError: CUDA error at /opt/src/kernels/attn.cu:88: out of memory"
    )
    text = public_message(RuntimeError(worker_error))
    assert text == (
        "the engine stopped: worker 127.0.0.1:5 failed: RuntimeError: CUDA error "
        "at attn.cu:88: out of memory"
    )
    assert public_message("x" * 5000).endswith("...") and len(public_message("x" * 5000)) == 2000
    assert public_message("max_tokens must be >= 1, got 0") == "max_tokens must be >= 1, got 0"


def test_an_undecodable_request_names_the_string_field_that_is_not_utf8():
    request = generate_pb2.GenerateRequest()
    message = request.chat.messages.add(role="user")
    message.content.add(text="fine")
    message.content.add(text="MARK")
    raw = request.SerializeToString().replace(b"MARK", b"\xc3\x28\xff\xfe")
    with pytest.raises(Exception):
        generate_pb2.GenerateRequest.FromString(raw)
    assert undecodable(generate_pb2.GenerateRequest.DESCRIPTOR, raw).message == (
        "chat.messages[0].content[1].text: not valid UTF-8 (string fields must hold UTF-8 text)"
    )
    assert (
        "not a valid tokenbudget.v1.GenerateRequest message"
        in undecodable(generate_pb2.GenerateRequest.DESCRIPTOR, b"\x0f\xff\xff").message
    )
