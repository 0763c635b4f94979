"""What a server tells its clients about embeddings, over engines whose
executor (FakeExecutor) samples for every request, pooling ones included, as
a worker that predates pooling does:

* a pooling request there: Generation.Embed ends with UNIMPLEMENTED and the
  gateway's Embed answers in band with HTTP 501, both saying why; the KV is
  freed and the server goes on generating;
* the gateway's GetModelInfo says ``is_generation=False`` for an embedding
  checkpoint (sentence-transformers Pooling module), as SGLang and vLLM do,
  and True otherwise, ``--pooler-config`` or not."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest

from tokenbudget.core import CacheConfig, PoolerConfig, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.proto import sglang_scheduler_pb2 as sgl
from tokenbudget.server.engine.async_engine import AsyncEngine
from tokenbudget.server.entrypoints.grpc.sglang import SglangSchedulerServicer
from tokenbudget.server.testing.tiny_models import add_sentence_transformers_files

from .test_embedded_service import FAKE_TOKEN, FakeExecutor

REASON = "the worker does not support pooling requests"


def _engine(model: str, pooler_config: PoolerConfig | None = None) -> AsyncEngine:
    from tokenbudget.server.engine.input_processor import InputProcessor

    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=512),
        CacheConfig(block_size=16),
        FakeExecutor(),
    )
    return AsyncEngine(
        core, InputProcessor.from_pretrained(model), model_name=model, pooler_config=pooler_config
    )


@pytest.fixture(scope="module")
def sampling_only(tiny_qwen3_path, serving):
    engine = _engine(tiny_qwen3_path)
    with serving(engine) as client:
        yield client, engine


def _no_request_left(engine: AsyncEngine) -> bool:
    engine.core.scheduler.kv_cache_manager.block_pool.check_invariants()
    return engine.num_requests == 0


def test_generation_embed_is_unimplemented_with_the_reason(sampling_only):
    client, engine = sampling_only
    with pytest.raises(grpc.RpcError) as err:
        client.embed(list(range(10, 50)), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert REASON in err.value.details() and "upgrade the worker" in err.value.details()
    assert _no_request_left(engine)
    out = client.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.token_ids == [FAKE_TOKEN] * 2


def _call(servicer: SglangSchedulerServicer, method: str, request):
    return asyncio.run(getattr(servicer, method)(request, None))


def test_gateway_embed_answers_501_in_band(sampling_only):
    _, engine = sampling_only
    reply = _call(
        SglangSchedulerServicer(engine),
        "Embed",
        sgl.EmbedRequest(
            request_id="sgl-unsupported",
            tokenized=sgl.TokenizedInput(input_ids=list(range(10, 50))),
        ),
    )
    assert reply.WhichOneof("response") == "error", reply
    assert reply.error.code == "501"
    assert REASON in reply.error.message
    assert _no_request_left(engine)


@pytest.mark.parametrize(
    "sentence_transformers,pooler_config,is_generation",
    [
        (None, None, True),
        (None, PoolerConfig("MEAN", False), True),  # a pooling default is no embedding model
        (("lasttoken", True), None, False),  # Qwen3-Embedding's files
        (("mean", False), PoolerConfig("LAST", True), False),
    ],
)
def test_gateway_model_info_says_is_generation_as_sglang_does(
    tiny_qwen3_path, tmp_path, sentence_transformers, pooler_config, is_generation
):
    model = shutil.copytree(tiny_qwen3_path, tmp_path / "model")
    if sentence_transformers:
        add_sentence_transformers_files(model, *sentence_transformers)
    engine = _engine(str(model), pooler_config)
    try:
        info = _call(SglangSchedulerServicer(engine), "GetModelInfo", sgl.GetModelInfoRequest())
    finally:
        engine.shutdown()
    assert info.is_generation is is_generation
    assert list(info.architectures) == ["Qwen3ForCausalLM"]  # the architecture says nothing
