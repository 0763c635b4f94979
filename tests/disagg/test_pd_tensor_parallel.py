"""Disaggregated prefill/decode with tensor parallelism: each of the two
ranks of the prefill writes its own KV heads into the same rank of the
decode (the ranks' handshakes gathered in rank order, a send finished only
once both ranks wrote their share), so greedy tokens through the gateway
equal transformers'; a decode with another TP size is refused by the
prefill in one line, and nothing is left allocated on either side."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.disagg.pd_cluster import (
    TIMEOUT,
    body,
    generate,
    hf_greedy,
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


@dataclass
class Cluster:
    prefill: Process  # 2 ranks
    decode: Process  # 2 ranks
    decode_tp1: Process
    gateway: Gateway  # prefill + decode
    unequal: Gateway  # prefill + decode_tp1


@pytest.fixture(scope="module")
def cluster(tiny_model, tiktoken_dir, tmp_path_factory) -> Cluster:
    log_dir = tmp_path_factory.mktemp("pd_tp_logs")
    port = free_port()
    servers = [
        server(
            "prefill-tp2",
            tiny_model,
            log_dir,
            "-tp",
            "2",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(port),
        ),
        server("decode-tp2", tiny_model, log_dir, "-tp", "2", "--disaggregation-mode", "decode"),
        server("decode-tp1", tiny_model, log_dir, "--disaggregation-mode", "decode"),
    ]
    gateways: list[Gateway] = []
    try:
        for s in servers:
            s.wait_listening()
        prefill, decode, decode_tp1 = servers
        for name, d in (("gateway-tp2", decode), ("gateway-unequal", decode_tp1)):
            gateways.append(pd_gateway(name, prefill, d, port, tiny_model, log_dir, tiktoken_dir))
    except Exception:
        for p in (*gateways, *servers):
            p.stop()
        raise
    yield Cluster(*servers, *gateways)
    for p in (*gateways, *servers):
        p.stop()


def test_each_rank_moves_its_own_heads_and_tokens_equal_transformers(cluster, tiny_model):
    oracle = hf_greedy(tiny_model)
    for prompt in random_prompts((9, 40), seed=2):
        want = oracle(prompt)
        assert generate(cluster.gateway, prompt) == [want], len(prompt)
        assert generate(cluster.gateway, prompt, 2, stream=True) == [want, want], len(prompt)


def test_a_decode_with_another_tp_size_is_refused_in_one_line(cluster):
    prompt = random_prompts((20,), seed=3)[0]
    status, out = cluster.unequal.post("/generate", body(cluster.unequal, prompt))
    assert status == 500, out
    message = out["error"]["message"]
    assert "the decode has 1 TP ranks and this prefill 2" in message, message
    assert "\n" not in message
    wait_all_blocks_free([cluster.prefill, cluster.decode, cluster.decode_tp1], TIMEOUT + 15)
