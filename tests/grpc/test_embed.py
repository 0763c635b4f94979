"""Generation.Embed and SglangScheduler.Embed through the real `server`
processes (an in-process worker and a remote one), against transformers'
hidden states pooled the same way (within 1e-5: float32 on CPU, the wire
carries float32)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from tokenbudget.proto import generate_pb2, generate_pb2_grpc
from tokenbudget.proto import sglang_scheduler_pb2 as sgl
from tokenbudget.proto import sglang_scheduler_pb2_grpc as sgl_grpc
from tokenbudget.server.entrypoints.client import Client

from .conftest import MAX_NUM_BATCHED_TOKENS

ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_base(tiny_model):
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    # Longer than the servers' 64-token budget: pooled over three chunks.
    return np.random.default_rng(7).integers(20, 900, size=150).tolist()


def pooled(hf_base, ids: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_base(torch.tensor([ids])).last_hidden_state[0]
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec


def close(got, want: torch.Tensor) -> float:
    return (torch.tensor(list(got)) - want).abs().max().item()


@pytest.mark.parametrize("where", ["local", "remote"])
@pytest.mark.parametrize("pooling_type,normalize", [("MEAN", False), ("CLS", True), ("LAST", None)])
def test_embed_equals_transformers_pooled_hidden_states(
    cluster, hf_base, long_prompt, where, pooling_type, normalize
):
    assert len(long_prompt) > 2 * MAX_NUM_BATCHED_TOKENS
    kwargs = {"pooling_type": pooling_type}
    if normalize is not None:
        kwargs["normalize"] = normalize
    with Client(getattr(cluster, where).address) as c:
        out = c.embed(long_prompt, timeout=60, **kwargs)
    applied = normalize if normalize is not None else True  # the model's default: normalised
    assert (out.pooling_type, out.normalize) == (pooling_type, applied)
    assert out.prompt_tokens == len(long_prompt)
    assert close(out.embedding, pooled(hf_base, long_prompt, pooling_type, applied)) <= ATOL


def test_text_embedding_uses_the_servers_tokenizer(client, oracle, hf_base):
    text = "The quick brown fox jumps over the lazy dog"
    out = client.embed(text, pooling_type="MEAN")
    ids = oracle.tokenizer.encode(text)
    assert out.prompt_tokens == len(ids)
    assert close(out.embedding, pooled(hf_base, ids, "MEAN", True)) <= ATOL
    assert client.embed({"text": text}, pooling_type="MEAN").embedding == out.embedding


def test_embed_beside_streaming_generation(cluster, oracle, hf_base, long_prompt):
    """Embeddings and greedy generations sent together to one server: the
    tokens equal the in-process oracle's, the vectors the transformers ones."""
    from tokenbudget.core import SamplingParams

    gen_prompts = [long_prompt[:40], long_prompt[50:90]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [
        r.token_ids for r in oracle.generate([{"prompt_token_ids": p} for p in gen_prompts], greedy)
    ]
    got_tokens: dict[int, list[int]] = {}
    got_vectors: dict[int, list[float]] = {}
    with Client(cluster.local.address) as c:

        def gen(i):
            got_tokens[i] = c.generate(gen_prompts[i], greedy).token_ids

        def emb(i):
            got_vectors[i] = c.embed(
                long_prompt[i * 10 :], pooling_type="MEAN", normalize=False
            ).embedding

        threads = [threading.Thread(target=gen, args=(i,)) for i in range(2)] + [
            threading.Thread(target=emb, args=(i,)) for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [got_tokens[i] for i in range(2)] == expected
    for i in range(3):
        want = pooled(hf_base, long_prompt[i * 10 :], "MEAN", False)
        assert close(got_vectors[i], want) <= ATOL


@pytest.mark.parametrize(
    "fields,code,message",
    [
        (
            {"token_ids": {"ids": [1, 2]}, "pooling_params": {"pooling_type": "MAX"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "pooling_params.pooling_type must be one of",
        ),
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "text: the prompt must not be empty"),
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "input: set one of text or token_ids"),
        ({"token_ids": {"ids": []}}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids: the prompt"),
        ({"token_ids": {"ids": [5, 10**7]}}, grpc.StatusCode.INVALID_ARGUMENT, "10000000"),
        ({"request_id": "", "text": "hi"}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ],
)
def test_bad_embed_requests_name_the_field(cluster, fields, code, message):
    with grpc.insecure_channel(cluster.local.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(generate_pb2.EmbedRequest(**fields), timeout=30)
    assert err.value.code() == code
    assert message in err.value.details()


def test_sglang_embed_serves_the_default_pooling(cluster, client, long_prompt):
    with grpc.insecure_channel(cluster.local.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        reply = stub.Embed(
            sgl.EmbedRequest(
                request_id="sgl-1", tokenized=sgl.TokenizedInput(input_ids=long_prompt)
            ),
            timeout=30,
        )
        bad = stub.Embed(sgl.EmbedRequest(request_id="sgl-2"), timeout=30)
    assert reply.WhichOneof("response") == "complete", reply
    ours = client.embed(long_prompt)
    assert reply.complete.embedding_dim == len(ours.embedding)
    assert reply.complete.prompt_tokens == len(long_prompt)
    assert np.allclose(reply.complete.embedding, ours.embedding, atol=0)
    assert bad.WhichOneof("response") == "error"
    assert bad.error.code == "400" and "tokenized.input_ids" in bad.error.message
