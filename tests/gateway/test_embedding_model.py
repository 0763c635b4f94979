"""An embedding checkpoint (sentence-transformers files naming a Pooling
module, as Qwen3-Embedding ships) behind the real gateway: GetModelInfo says
``is_generation=False`` as SGLang and vLLM do, and sglang-router 0.3.2 still
routes /v1/embeddings (and, as we serve it, /v1/chat/completions) to it."""

from __future__ import annotations

import shutil

import grpc
import pytest

from tokenbudget.proto import sglang_scheduler_pb2 as pb
from tokenbudget.proto import sglang_scheduler_pb2_grpc as pb_grpc
from tokenbudget.server.entrypoints.client import Client
from tokenbudget.server.testing.tiny_models import add_sentence_transformers_files

from .conftest import start_gateway, start_server


@pytest.fixture(scope="module")
def embedder(tiny_model, tiktoken_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedder")
    model = str(shutil.copytree(tiny_model, folder / "model"))
    add_sentence_transformers_files(model, "mean", False)
    server = start_server("embedder", model, folder).wait_listening()
    try:
        gateway = start_gateway("embedder-gateway", [server], model, folder, tiktoken_dir)
    except Exception:
        server.stop()
        raise
    yield server, gateway
    gateway.stop()
    server.stop()


def test_embedding_checkpoint_says_it_is_not_generation_and_is_routed(embedder):
    server, gw = embedder
    with grpc.insecure_channel(server.address) as ch:
        info = pb_grpc.SglangSchedulerStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.is_generation is False and info.model_path == gw.model
    (worker,) = gw.get("/workers")[1]["workers"]
    assert "is_generation" not in worker["metadata"]  # the gateway keeps only a true one

    status, body = gw.post("/v1/embeddings", {"model": gw.model, "input": "hello world"})
    assert status == 200, body
    with Client(server.address) as c:
        ours = c.embed("hello world")
    assert (ours.pooling_type, ours.normalize) == ("MEAN", False)  # the checkpoint's pooling
    vector = body["data"][0]["embedding"]
    assert max(abs(a - b) for a, b in zip(vector, ours.embedding, strict=True)) <= 1e-6

    status, body = gw.post(
        "/v1/chat/completions",
        {"model": gw.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert status == 200, body
    assert 1 <= body["usage"]["completion_tokens"] <= 3  # the random model may end early
