"""Disaggregated prefill/decode when things go wrong, end to end: a real
prefill and decode `server` on loopback behind the real SGLang gateway (and
called directly, as the gateway calls them, where a test needs one half to
arrive late or never). Each test ends with both servers holding every KV
block free and no request (GetStats), and a next request through the
gateway that equals transformers' greedy tokens.

The prefill runs one sequence at a time (--max-num-seqs 1) in steps of 16
tokens, so a request of ours (tokenbudget.v1.Generation) holding its slot
keeps the gateway's half waiting, and a long prompt takes many steps; it
logs at debug level, where each finished KV send names its block count."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.disagg.pd_cluster import (
    BLOCK,
    body,
    blocks_in_use,
    generate,
    hf_greedy as load_hf_greedy,
    pd_gateway,
    random_prompts,
    server,
    sglang_abort,
    sglang_generate,
    wait_all_blocks_free,
    wait_blocks_in_use,
    wait_healthy,
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

# Both servers' --disaggregation-timeout: short, so a deadline test is quick,
# and long enough to tell "freed at once" (an abort) from "freed at the deadline".
TIMEOUT = 3.0
# The killed prefill's prompt, in blocks (both servers have 255).
LONG_BLOCKS = 240
SENT = re.compile(r"KV of room (\d+) sent, (\d+) blocks")


@dataclass
class Faults:
    prefill: Process
    decode: Process
    gateway: Gateway
    model: str
    log_dir: Path
    port: int  # the prefill's gRPC port, kept when it is restarted
    bootstrap_port: int


def _prefill(name: str, model: str, log_dir: Path, port: int, bootstrap_port: int) -> Process:
    return server(
        name,
        model,
        log_dir,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
        "--port",
        str(port),
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        str(BLOCK),
        "--log-level",
        "debug",
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def faults(tiny_model, tiktoken_dir, tmp_path_factory) -> Faults:
    log_dir = tmp_path_factory.mktemp("pd_fault_logs")
    port, bootstrap_port = free_port(), free_port()
    servers = [
        _prefill("prefill", tiny_model, log_dir, port, bootstrap_port),
        server("decode", tiny_model, log_dir, "--disaggregation-mode", "decode", timeout=TIMEOUT),
    ]
    gateway = None
    try:
        for s in servers:
            s.wait_listening()
        gateway = pd_gateway(
            "pd-gateway", *servers, bootstrap_port, tiny_model, log_dir, tiktoken_dir
        )
    except Exception:
        for p in servers:
            p.stop()
        raise
    f = Faults(*servers, gateway, tiny_model, log_dir, port, bootstrap_port)
    yield f
    for p in (f.gateway, f.prefill, f.decode):
        p.stop()


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    return load_hf_greedy(tiny_model)


def _next_request_succeeds(f: Faults, hf_greedy, seed: int) -> None:
    """Both sides hold nothing, and a fresh request through the gateway decodes right."""
    wait_all_blocks_free([f.prefill, f.decode], TIMEOUT + 5)
    prompt = random_prompts([2 * BLOCK + 3], seed)[0]
    assert generate(f.gateway, prompt) == [hf_greedy(prompt)]
    wait_all_blocks_free([f.prefill, f.decode], TIMEOUT + 5)


def _sent(prefill: Process) -> dict[int, int]:
    """Blocks the prefill sent, by room (its debug log)."""
    return {int(room): int(n) for room, n in SENT.findall(prefill.log)}


def test_a_decode_side_prefix_hit_moves_only_the_missing_blocks(faults, hf_greedy):
    """Two prompts of 68 tokens (5 blocks) sharing a 3-block prefix: the
    first moves all its 5 blocks; the decode keeps them as prefix hits, so
    the second moves only its 2 blocks past the prefix, and the second again
    only its partial last block (not cached); each decodes right."""
    prefix = random_prompts([3 * BLOCK], seed=2801)[0]
    tail = random_prompts([20], seed=2812)[0]
    other = [t + 1 for t in tail]
    for prompt, moved in ((prefix + tail, 5), (prefix + other, 2), (prefix + other, 1)):
        before = _sent(faults.prefill)
        assert generate(faults.gateway, prompt) == [hf_greedy(prompt)]
        sent = {room: n for room, n in _sent(faults.prefill).items() if room not in before}
        assert list(sent.values()) == [moved], sent
    with Client(faults.decode.address) as client:
        assert client.stats().prefix_cache_hits >= 3 * BLOCK
    _next_request_succeeds(faults, hf_greedy, seed=2803)


def test_the_decodes_deadline_ends_a_request_whose_prefill_never_runs(faults, hf_greedy):
    """The decode registers with a live prefill that never gets its half of
    the request: an in-band error about TIMEOUT later, both sides free."""
    prompt = random_prompts([40], seed=2804)[0]
    start = time.monotonic()
    channel, call = sglang_generate(
        faults.decode.address, prompt, 2804, faults.bootstrap_port, "deadline-1"
    )
    replies = list(call)
    elapsed = time.monotonic() - start
    channel.close()
    assert [r.WhichOneof("response") for r in replies] == ["error"], replies
    assert "did not arrive from the prefill" in replies[0].error.message, replies
    assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + 5, elapsed
    _next_request_succeeds(faults, hf_greedy, seed=2805)


def test_an_abort_before_the_transfer_frees_the_decode_at_once(faults, hf_greedy):
    """The decode's request waits for a prefill that has not run its half
    yet; the gateway's Abort frees its blocks at once (long before the
    deadline). The prefill, given its half only afterwards, computes it but
    sends nothing into the freed blocks, and frees its own."""
    prompt, room, rid = random_prompts([50], seed=2806)[0], 2806, "abort-early-1"
    channel, call = sglang_generate(faults.decode.address, prompt, room, faults.bootstrap_port, rid)
    call.initial_metadata()
    wait_blocks_in_use(faults.decode, 10)
    time.sleep(0.3)  # its registration reaches the prefill's listener
    start = time.monotonic()
    assert sglang_abort(faults.decode.address, rid)
    replies = list(call)
    wait_all_blocks_free([faults.decode], TIMEOUT / 2)
    assert time.monotonic() - start < TIMEOUT / 2
    channel.close()
    assert all(r.WhichOneof("response") != "chunk" or not r.chunk.token_ids for r in replies)
    # The prefill's half, late: it runs (one token) and keeps nothing.
    channel, call = sglang_generate(
        faults.prefill.address, prompt, room, faults.bootstrap_port, rid
    )
    replies = list(call)
    channel.close()
    assert replies and replies[-1].WhichOneof("response") == "complete", replies
    wait_all_blocks_free([faults.prefill, faults.decode], TIMEOUT + 5)
    assert room not in _sent(faults.prefill)
    assert f"room {room} already taken; not sent" in faults.prefill.log
    _next_request_succeeds(faults, hf_greedy, seed=2807)


def test_a_prefill_side_abort_before_the_kv_fails_the_decode_at_once(faults, hf_greedy):
    """The gateway's Abort reaching the prefill while its half still waits
    (a request of ours holds its one slot): the decode's registration is
    answered with an error at once, so its client gets an in-band error long
    before the deadline, and both sides free."""
    prompt, room, rid = random_prompts([50], seed=2813)[0], 2813, "abort-prefill-1"
    with Client(faults.prefill.address) as client:
        occupier = client.generate_stream(
            {"prompt_token_ids": [5, 6, 7]},
            SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True),
        )
        next(occupier)  # running: the prefill's slot is taken
        halves = [
            sglang_generate(p.address, prompt, room, faults.bootstrap_port, rid)
            for p in (faults.prefill, faults.decode)
        ]
        for _, call in halves:
            call.initial_metadata()
        wait_blocks_in_use(faults.decode, 10)
        time.sleep(0.3)  # its registration reaches the prefill's listener
        start = time.monotonic()
        assert sglang_abort(faults.prefill.address, rid)
        replies = list(halves[1][1])
        elapsed = time.monotonic() - start
        occupier.close()
    for channel, _ in halves:
        channel.close()
    assert [r.WhichOneof("response") for r in replies] == ["error"], replies
    assert "ended (abort) before its KV" in replies[0].error.message, replies
    assert elapsed < TIMEOUT / 2, elapsed
    assert room not in _sent(faults.prefill)
    _next_request_succeeds(faults, hf_greedy, seed=2814)


def test_a_client_gone_while_its_decode_waits_for_the_prefill_leaks_nothing(faults, hf_greedy):
    """A request of ours holds the prefill's one sequence slot, so the
    gateway's prefill half waits in its queue while the decode half waits
    for the KV; then the client goes away. The gateway notices a silent
    client only once it has something to write to it (here: the decode's
    deadline error), so the decode frees by its deadline, not at once (an
    Abort that reaches it does free it at once: the test above); the gateway
    then drops the prefill's half. Nothing is sent and nothing leaks."""
    prompt = random_prompts([60], seed=2808)[0]
    before = _sent(faults.prefill)
    with Client(faults.prefill.address) as client:
        occupier = client.generate_stream(
            {"prompt_token_ids": [5, 6, 7]},
            SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True),
        )
        next(occupier)  # running: the prefill's slot is taken
        conn = http.client.HTTPConnection("127.0.0.1", faults.gateway.port, timeout=60)
        request = {**body(faults.gateway, prompt), "stream": True}
        conn.request("POST", "/generate", json.dumps(request), {"Content-Type": "application/json"})
        wait_blocks_in_use(faults.decode, 10)
        time.sleep(0.3)  # its registration reaches the prefill's listener
        conn.close()
        wait_all_blocks_free([faults.decode], TIMEOUT + 2)
        with Client(faults.prefill.address) as probe:  # the occupier, and no half of ours
            assert probe.stats().num_requests == 1
        occupier.close()  # cancels it on the prefill
    wait_all_blocks_free([faults.prefill, faults.decode], TIMEOUT + 5)
    assert _sent(faults.prefill) == before
    _next_request_succeeds(faults, hf_greedy, seed=2809)


def test_a_prefill_killed_mid_request_fails_the_client_and_the_decode_frees(faults, hf_greedy):
    """A long prompt (240 prefill steps of 16 tokens, about a second here):
    once the decode has registered its blocks for it, the prefill is killed
    (SIGKILL) while it computes that KV. The client
    gets an error, not a hang; the decode frees everything; a prefill started
    again on the same ports serves the next request."""
    prompt = random_prompts([LONG_BLOCKS * BLOCK], seed=2810)[0]
    result: dict = {}

    def client() -> None:
        start = time.monotonic()
        result["reply"] = faults.gateway.post("/generate", body(faults.gateway, prompt))
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    wait_blocks_in_use(faults.decode, 10)
    assert blocks_in_use(faults.decode) >= LONG_BLOCKS
    faults.prefill.proc.kill()
    faults.prefill.proc.wait(10)
    thread.join(40)
    assert not thread.is_alive(), "the client hangs"
    status, out = result["reply"]
    assert status >= 500, (status, out)
    assert result["elapsed"] < 30, result
    wait_all_blocks_free([faults.decode], 10)
    faults.prefill = _prefill(
        "prefill-again", faults.model, faults.log_dir, faults.port, faults.bootstrap_port
    )
    faults.prefill.wait_listening()
    wait_healthy(faults.gateway, 30)
    _next_request_succeeds(faults, hf_greedy, seed=2811)
