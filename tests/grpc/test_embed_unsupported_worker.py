"""A pooling request on a worker that only samples (one that predates
pooling): Generation.Embed ends with UNIMPLEMENTED and the gateway's Embed
answers in band with HTTP 501, both saying why; the KV is freed and the
server goes on serving generation."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tokenbudget.core import CacheConfig, EngineCore, SamplingParams, SchedulerConfig
from tokenbudget.proto import sglang_scheduler_pb2 as sgl
from tokenbudget.server.async_engine import AsyncEngine
from tokenbudget.server.sglang_service import SglangSchedulerServicer

from .test_embedded_service import FAKE_TOKEN, FakeExecutor

REASON = "the worker does not support pooling requests"


@pytest.fixture(scope="module")
def sampling_only(tiny_qwen3_path, serving):
    """An engine over FakeExecutor, which samples for every request, pooling
    ones included, as a worker that ignores pooling_params does."""
    from tokenbudget.server.input_processor import InputProcessor

    core = EngineCore(SchedulerConfig(max_num_batched_tokens=64, max_model_len=512),
                      CacheConfig(block_size=16), FakeExecutor())
    engine = AsyncEngine(core, InputProcessor.from_pretrained(tiny_qwen3_path),
                         model_name=tiny_qwen3_path)
    with serving(engine) as client:
        yield client, engine


def _no_blocks_held(engine: AsyncEngine) -> bool:
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    return engine.num_requests == 0


def test_generation_embed_is_unimplemented_with_the_reason(sampling_only):
    client, engine = sampling_only
    with pytest.raises(grpc.RpcError) as err:
        client.embed(list(range(10, 50)), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert REASON in err.value.details() and "upgrade the worker" in err.value.details()
    assert _no_blocks_held(engine)
    out = client.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.token_ids == [FAKE_TOKEN] * 2


def test_gateway_embed_answers_501_in_band(sampling_only):
    _, engine = sampling_only
    servicer = SglangSchedulerServicer(engine)

    async def embed() -> sgl.EmbedResponse:
        return await servicer.Embed(sgl.EmbedRequest(
            request_id="sgl-unsupported", tokenized=sgl.TokenizedInput(
                input_ids=list(range(10, 50)))), context=None)

    reply = asyncio.run(embed())
    assert reply.WhichOneof("response") == "error", reply
    assert reply.error.code == "501"
    assert REASON in reply.error.message
    assert _no_blocks_held(engine)
