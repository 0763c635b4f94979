"""Disaggregated prefill/decode through the real SGLang gateway
(``--pd-disaggregation``): one prefill and one decode `server` process on
loopback, KV moved by NIXL. Greedy tokens equal a colocated server's and
transformers generate()'s for prompts of 1-4 blocks, the longer ones
chunked on the prefill side (its --max-num-batched-tokens is below their
length), streamed and not, n=1 and n=2; afterwards both sides hold every KV
block free, and the KV the decode received is the prompt's (a later request
on the decode alone reuses it as prefix hits and still matches)."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass

import pytest

from tests.disagg.pd_cluster import (
    BLOCK,
    NEW_TOKENS,
    TIMEOUT,
    body,
    generate,
    hf_greedy as load_hf_greedy,
    pd_gateway,
    random_prompts,
    server,
    wait_all_blocks_free,
)
from tests.gateway.conftest import (
    Gateway,
    Process,
    free_port,
    tiktoken_dir as tiktoken_dir,  # fixtures of the gateway tests, shared
    tiny_model as tiny_model,
)
from tokenbudget.core import SamplingParams
from tokenbudget.server.entrypoints.client import Client

# The prefill's step budget: prompts longer than this are prefilled in chunks.
PREFILL_BUDGET = 24
# 1 block (partial), exactly 1, 3 (chunked), 4 full (chunked) blocks.
PROMPT_LENS = (5, 16, 33, 64)


@dataclass
class Pair:
    prefill: Process
    decode: Process
    colocated: Process
    gateway: Gateway
    # A gateway told a wrong bootstrap port: its decodes cannot reach the prefill.
    misrouted: Gateway
    model: str
    bootstrap_port: int


@pytest.fixture(scope="module")
def pair(tiny_model, tiktoken_dir, tmp_path_factory) -> Pair:
    log_dir = tmp_path_factory.mktemp("pd_logs")
    bootstrap_port = free_port()
    servers = [
        server(
            "prefill",
            tiny_model,
            log_dir,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
            "--max-num-batched-tokens",
            str(PREFILL_BUDGET),
        ),
        # vLLM's spelling of the decode role (the same as --disaggregation-mode decode).
        server(
            "decode",
            tiny_model,
            log_dir,
            "--kv-transfer-config",
            '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}',
        ),
        server("colocated", tiny_model, log_dir),
    ]
    gateways: list[Gateway] = []
    try:
        for s in servers:
            s.wait_listening()
        for name, port in (("pd-gateway", bootstrap_port), ("misrouted-gateway", free_port())):
            gateways.append(pd_gateway(name, *servers[:2], port, tiny_model, log_dir, tiktoken_dir))
    except Exception:
        for p in (*gateways, *servers):
            p.stop()
        raise
    yield Pair(*servers, *gateways, tiny_model, bootstrap_port)
    for p in (*gateways, *servers):
        p.stop()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENS, seed=28)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    return load_hf_greedy(tiny_model)


@pytest.fixture(scope="module")
def oracle(hf_greedy, prompts) -> list[list[int]]:
    return [hf_greedy(p) for p in prompts]


def _generate(pair: Pair, prompt: list[int], n: int, stream: bool) -> list[list[int]]:
    return generate(pair.gateway, prompt, n, stream)


def _colocated(pair: Pair, prompt: list[int]) -> list[int]:
    with Client(pair.colocated.address) as client:
        done = client.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        )
    return done.token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_tokens_equal_a_colocated_server_and_transformers(pair, prompts, oracle, stream):
    for prompt, want in zip(prompts, oracle):
        assert _colocated(pair, prompt) == want, len(prompt)
        # A fresh room each time; the decode may hold a prefix of it by now.
        assert _generate(pair, prompt, 1, stream) == [want], (len(prompt), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_samples_are_two_transfers_that_both_decode_greedily(pair, prompts, hf_greedy, stream):
    # Prompts the decode has not seen (no prefix of them cached there): every block moves.
    for prompt in prompts:
        fresh = [prompt[0] + (7 if stream else 3), *prompt[1:]]
        want = hf_greedy(fresh)
        assert _generate(pair, fresh, 2, stream) == [want, want], (len(prompt), stream)


def test_the_decodes_received_kv_is_the_prompts(pair, prompts, oracle):
    """A prompt the decode received over P/D is in its prefix cache: served
    on the decode alone (our API runs it colocated there), its full blocks
    are hits, and the tokens still equal the oracle's, so those blocks hold
    the prompt's KV as the prefill computed it."""
    prompt, want = prompts[-1], oracle[-1]
    assert _generate(pair, prompt, 1, False) == [want]
    with Client(pair.decode.address) as client:
        before = client.stats().prefix_cache_hits
        done = client.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        )
        hits = client.stats().prefix_cache_hits - before
    assert done.token_ids == want
    assert done.cached_tokens >= (len(prompt) - 1) // BLOCK * BLOCK
    assert hits >= done.cached_tokens


def _decode_call(pair: Pair, prompt: list[int], bootstrap_port: int, room: int):
    """A Generate straight to the decode's SglangScheduler, as the gateway sends it."""
    import grpc

    from tokenbudget.proto import sglang_scheduler_pb2 as sg, sglang_scheduler_pb2_grpc

    channel = grpc.insecure_channel(pair.decode.address)
    request = sg.GenerateRequest(
        request_id=f"direct-{room}",
        tokenized=sg.TokenizedInput(input_ids=prompt),
        sampling_params=sg.SamplingParams(
            max_new_tokens=4, top_p=1, top_k=-1, repetition_penalty=1
        ),
        disaggregated_params=sg.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=room
        ),
    )
    stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    return channel, stub.Generate(request, timeout=60)


def test_a_decode_never_computes_a_prompt_itself_its_kv_must_come_from_the_prefill(pair, prompts):
    """No prefill listens, or the prefill never got the room: the decode
    answers an in-band error (no tokens it computed itself), and its
    response headers went out at once so the gateway is not held up."""
    nobody = free_port()
    channel, call = _decode_call(pair, prompts[2], nobody, 1)
    replies = list(call)
    channel.close()
    assert [r.WhichOneof("response") for r in replies] == ["error"], replies
    assert replies[0].error.http_status_code == "500"
    # The prefill listens but never gets this room: the decode's deadline ends it.
    start = time.monotonic()
    channel, call = _decode_call(pair, prompts[1], pair.bootstrap_port, 2)
    call.initial_metadata()  # the headers, long before the answer
    headers_after = time.monotonic() - start
    replies = list(call)
    elapsed = time.monotonic() - start
    channel.close()
    assert headers_after < TIMEOUT / 2, headers_after
    assert [r.WhichOneof("response") for r in replies] == ["error"], replies
    assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + 10, elapsed


def test_a_decode_that_cannot_reach_its_prefill_fails_the_request_without_a_hang(
    pair, prompts, oracle
):
    request = body(pair.misrouted, prompts[3])
    start = time.monotonic()
    status, out = pair.misrouted.post("/generate", request)
    assert status == 500, out
    assert "did not arrive from the prefill engine" in out["error"]["message"], out
    events = pair.misrouted.stream("/generate", request)
    assert len(events) == 1 and "did not arrive from the prefill" in events[0]["error"], events
    assert time.monotonic() - start < 30
    # The pair still serves through a gateway that routes it right.
    assert _generate(pair, prompts[3], 1, True) == [oracle[3]]


def test_a_client_that_disconnects_mid_stream_leaves_the_pair_serving(pair, prompts, oracle):
    request = body(pair.gateway, prompts[2])
    request["sampling_params"]["max_new_tokens"] = 2000
    conn = http.client.HTTPConnection("127.0.0.1", pair.gateway.port, timeout=60)
    conn.request(
        "POST",
        "/generate",
        json.dumps({**request, "stream": True}),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    for line in response:
        if line.startswith(b"data: "):
            break  # the first tokens came: the decode is running
    conn.close()
    assert _generate(pair, prompts[0], 1, False) == [oracle[0]]


def test_every_kv_block_is_free_on_both_sides_afterwards(pair, prompts):
    # Run last in this module: after every request above (and one more here).
    _generate(pair, prompts[0], 1, False)
    # A prefill frees a prompt no decode registered for after TIMEOUT.
    wait_all_blocks_free([pair.prefill, pair.decode], TIMEOUT + 15)
