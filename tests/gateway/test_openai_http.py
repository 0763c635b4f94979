"""OpenAI-compatible HTTP through the real gateway: the same tokens as our own
gRPC API, usage, max_tokens, stop strings, n, and the KV freed when an HTTP
client goes away mid-stream."""

from __future__ import annotations

import http.client
import json
import time

import grpc
import pytest

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.proto import sglang_scheduler_pb2 as pb
from tokenbudget.proto import sglang_scheduler_pb2_grpc as pb_grpc


MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]


def ascii_part(text: str) -> str:
    """The random tiny model emits lone bytes of multi-byte characters: ours
    detokenizer shows them as U+FFFD, the gateway's drops them (with the
    character they would have completed). Tokens are compared exactly in the
    /generate tests; texts are compared on their ASCII characters."""
    return "".join(ch for ch in text if ch.isascii())


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def wait_all_free(clients, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = {name: c.stats() for name, c in clients.items()}
        if all(
            s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks
            for s in stats.values()
        ):
            return
        assert time.monotonic() < deadline, f"KV not freed within {timeout}s: {stats}"
        time.sleep(0.05)


def test_chat_completion_is_the_clients_greedy_text_with_its_usage(cluster, clients):
    gw = cluster.gateway
    status, body = gw.post(
        "/v1/chat/completions",
        {"model": gw.model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0},
    )
    assert status == 200, body
    want = clients["r1"].generate({"messages": MESSAGES}, greedy(12))
    choice = body["choices"][0]
    assert ascii_part(choice["message"]["content"]) == ascii_part(want.text)
    assert choice["finish_reason"] == want.finish_reason
    assert body["usage"]["prompt_tokens"] == want.prompt_tokens
    assert body["usage"]["completion_tokens"] == len(want.token_ids)


def test_streamed_chat_completion_joins_to_the_same_text_then_usage(cluster, clients):
    gw = cluster.gateway
    events = gw.stream(
        "/v1/chat/completions",
        {
            "model": gw.model,
            "messages": MESSAGES,
            "max_tokens": 10,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        },
    )
    want = clients["r1"].generate({"messages": MESSAGES}, greedy(10))
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert ascii_part(text) == ascii_part(want.text) and text
    assert finish == [want.finish_reason]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == want.prompt_tokens
    assert usage["completion_tokens"] == len(want.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_generate_returns_the_clients_greedy_token_ids(cluster, clients, stream):
    gw = cluster.gateway
    body = {
        "model": gw.model,
        "text": "The quick brown fox",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
    }
    want = clients["r2"].generate("The quick brown fox", greedy(16, ignore_eos=True))
    if stream:
        events = gw.stream("/generate", body)
        ids = [t for e in events for t in e["output_ids"]]
        meta = events[-1]["meta_info"]
    else:
        status, out = gw.post("/generate", body)
        assert status == 200, out
        ids, meta = out[0]["output_ids"], out[0]["meta_info"]
    assert ids == want.token_ids and len(ids) == 16
    reason = meta["finish_reason"]  # streamed: a string; otherwise {"type": ..., ...}
    assert (reason if stream else reason["type"]) == "length"
    assert meta["prompt_tokens"] == want.prompt_tokens and meta["completion_tokens"] == 16


def test_the_engine_enforces_max_tokens(cluster, clients):
    gw = cluster.gateway
    status, out = gw.post(
        "/generate",
        {
            "model": gw.model,
            "text": "count",
            "sampling_params": {"max_new_tokens": 7, "temperature": 0.8, "ignore_eos": True},
        },
    )
    assert status == 200, out
    assert len(out[0]["output_ids"]) == 7 and out[0]["meta_info"]["completion_tokens"] == 7


def test_a_stop_string_ends_the_text_and_the_engine_stops_there(cluster, clients):
    gw = cluster.gateway
    # A stop string taken from the greedy continuation itself (ASCII letters), so it fires.
    full = clients["r1"].generate({"messages": MESSAGES}, greedy(24, ignore_eos=True))
    start = next(
        i
        for i in range(len(full.text) // 3, len(full.text) - 2)
        if full.text[i : i + 3].isascii() and full.text[i : i + 3].isalpha()
    )
    stop = full.text[start : start + 3]
    status, body = gw.post(
        "/v1/chat/completions",
        {
            "model": gw.model,
            "messages": MESSAGES,
            "max_tokens": 24,
            "temperature": 0,
            "stop": [stop],
        },
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice.get("matched_stop") == stop
    assert ascii_part(choice["message"]["content"]) == ascii_part(
        full.text[: full.text.index(stop)]
    )
    # The engine stopped at the token that completed the stop string, not at max_tokens.
    want = clients["r1"].generate({"messages": MESSAGES}, greedy(24, stop=[stop]))
    assert body["usage"]["completion_tokens"] == len(want.token_ids) < 24


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_come_back_as_n_choices(cluster, stream):
    gw = cluster.gateway
    req = {"model": gw.model, "messages": MESSAGES, "max_tokens": 5, "n": 3, "temperature": 0}
    if stream:
        events = gw.stream("/v1/chat/completions", req)
        texts: dict[int, str] = {}
        finished = {}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finished[c["index"]] = c["finish_reason"]
        assert sorted(finished) == [0, 1, 2]
    else:
        status, body = gw.post("/v1/chat/completions", req)
        assert status == 200, body
        texts = {c["index"]: c["message"]["content"] for c in body["choices"]}
    assert sorted(texts) == [0, 1, 2]
    assert len(set(texts.values())) == 1 and texts[0]  # greedy: the same text three times


def test_a_client_that_disconnects_mid_stream_frees_its_kv(cluster, clients):
    gw = cluster.gateway
    generated = sum(c.stats().num_generated_tokens for c in clients.values())
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    conn.request(
        "POST",
        "/generate",
        json.dumps(
            {
                "model": gw.model,
                "text": "a long story " * 20,
                "stream": True,
                "sampling_params": {"max_new_tokens": 3500, "ignore_eos": True, "temperature": 0},
            }
        ),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    assert sum(c.stats().num_running for c in clients.values()) == 1
    conn.sock.close()
    conn.close()
    wait_all_free(clients, timeout=5.0)
    # Aborted, not run to its end (3500 tokens take several seconds here).
    assert sum(c.stats().num_generated_tokens for c in clients.values()) - generated < 1500


def test_a_refused_field_is_named_and_the_replica_stays_in_rotation(cluster, clients):
    gw = cluster.gateway
    for _ in range(3):  # the gateway retries each; more tries than its breaker's threshold (10)
        status, body = gw.post(
            "/generate",
            {
                "model": gw.model,
                "text": "hello",
                "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [10**6]},
            },
        )
        assert status >= 400 and "stop_token_ids" in body["error"]["message"], body
    assert gw.healthy_workers() == {f"grpc://{cluster.r1.address}", f"grpc://{cluster.r2.address}"}
    for _ in range(2):
        status, body = gw.post(
            "/generate",
            {"model": gw.model, "text": "hello", "sampling_params": {"max_new_tokens": 2}},
        )
        assert status == 200, body


def test_embeddings_through_the_gateway(cluster, clients):
    """/v1/embeddings reaches SglangScheduler.Embed: the replica's default
    pooling of the prompt the gateway tokenized."""
    gw = cluster.gateway
    status, body = gw.post("/v1/embeddings", {"model": gw.model, "input": "hello world"})
    assert status == 200, body
    vector = body["data"][0]["embedding"]
    ours = clients["r1"].embed("hello world")
    assert body["usage"]["prompt_tokens"] == ours.prompt_tokens
    assert max(abs(a - b) for a, b in zip(vector, ours.embedding, strict=True)) <= 1e-6


def test_model_info_and_loads_describe_the_replica(cluster, clients):
    with grpc.insecure_channel(cluster.r1.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    ours = clients["r1"].model_info()
    assert info.model_path == info.tokenizer_path == cluster.model
    assert info.served_model_name == cluster.model and info.is_generation
    # The gateway keeps it as a worker label (0.3.2 routes by nothing else in it).
    workers = {w["url"]: w for w in cluster.gateway.get("/workers")[1]["workers"]}
    assert workers[f"grpc://{cluster.r1.address}"]["metadata"]["is_generation"] == "true"
    assert info.max_context_length == ours.max_model_len and info.vocab_size == ours.vocab_size
    assert list(info.eos_token_ids) == list(ours.eos_token_ids)
    assert info.architectures == ["Qwen3ForCausalLM"] and info.model_type == "qwen3"
    assert loads.dp_rank_count == 1
    assert loads.loads[0].max_total_num_tokens == (ours.num_blocks - 1) * ours.block_size
    # The gateway lists the model under the served name.
    status, models = cluster.gateway.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [cluster.model]
