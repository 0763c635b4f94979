"""KV transfer for disaggregated prefill/decode (worker/kv_transfer_nixl.py),
with real NIXL over UCX on loopback: a send writes exactly its blocks (runs
merged into few descriptors), in one process or into another that runs no
code meanwhile; a peer with another layout fails the send, not the step; and
a decode engine continuing from transferred KV and the prefill's first token
samples what the prefill engine itself would have."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time

import pytest
import torch

# Runs in a pytest process of its own (test_kv_transfers_in_own_process.py);
# the Mooncake tests, in theirs, import its helpers.
if os.environ.get("TOKENBUDGET_TRANSFER_TESTS") not in ("nixl", "mooncake"):
    pytest.skip("runs in its own process", allow_module_level=True)

from tokenbudget.core import (  # noqa: E402 (after the skip)
    CacheConfig,
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.core.kv.connector import KVConnectorMetadata, KVSend  # noqa: E402
from tokenbudget.worker.kv_transfer_nixl import NixlKVTransfer, merge_runs  # noqa: E402
from tokenbudget.worker.worker import Worker  # noqa: E402

LAYERS, BS, HEADS, HEAD_DIM = 3, 4, 2, 8
SRC_IDS, DST_IDS = [3, 4, 5, 9], [7, 8, 9, 2]


def random_caches(
    num_blocks: int, seed: int, head_dim: int = HEAD_DIM, dtype=torch.float32, device="cpu"
):
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, BS, HEADS, head_dim)
    return [torch.randn(shape, generator=g).to(device, dtype) for _ in range(LAYERS)]


def copied(dst: list[torch.Tensor], src: list[torch.Tensor], src_ids, dst_ids):
    """The oracle: ``dst`` with blocks ``dst_ids`` of both halves of every
    layer replaced by ``src``'s blocks ``src_ids``."""
    out = [t.clone() for t in dst]
    for o, s in zip(out, src):
        o[:, dst_ids] = s[:, src_ids]
    return out


def settle(transfer: NixlKVTransfer, timeout_s: float = 10.0) -> tuple[set[str], dict[str, str]]:
    """Poll until some send settled; what settled."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        finished, failed = transfer.poll()
        if finished or failed:
            return finished, failed
        time.sleep(0.001)
    raise AssertionError("no KV send settled")


def assert_caches_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for layer, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"layer {layer} differs"


@pytest.fixture
def transfers():
    """Make rank-0 NixlKVTransfers, closed after the test even when it fails."""
    made: list[NixlKVTransfer] = []

    def make(caches) -> NixlKVTransfer:
        made.append(NixlKVTransfer(caches, 0, BS))
        return made[-1]

    yield make
    for t in made:
        t.close()


def test_merge_runs_joins_blocks_consecutive_on_both_sides():
    runs = merge_runs([3, 4, 5, 9, 10, 11], [7, 8, 1, 2, 3, 9])
    assert runs.tolist() == [[3, 7, 2], [5, 1, 1], [9, 2, 2], [11, 9, 1]]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_send_writes_exactly_its_blocks_in_few_descriptors(transfers, device):
    src, dst = random_caches(12, seed=0, device=device), random_caches(16, seed=1, device=device)
    src_before = [t.clone() for t in src]
    want = copied(dst, src, SRC_IDS, DST_IDS)
    sender, receiver = transfers(src), transfers(dst)
    send = KVSend("r", SRC_IDS, DST_IDS, [receiver.handshake()])
    sender.start(KVConnectorMetadata(sends=[send]))
    assert settle(sender) == ({"r"}, {})
    assert_caches_equal(dst, want)
    assert_caches_equal(src, src_before)
    # [3, 4, 5] -> [7, 8, 9] is one run, 9 -> 2 another: 2 runs, K and V, every layer.
    assert sender.num_descriptors == 2 * 2 * LAYERS
    assert sender.poll() == (set(), {})  # reported once
    # Nothing to write (the peer had every block): finished at once, no descriptors.
    sender.start(KVConnectorMetadata(sends=[KVSend("empty", [], [], [receiver.handshake()])]))
    assert sender.poll() == ({"empty"}, {})
    assert sender.num_descriptors == 2 * 2 * LAYERS


# The receiving process: registers its cache, hands out its handshake, then
# runs nothing but a blocking read until the sender is done.
_RECEIVER = """
import base64, sys, torch
torch.set_num_threads(1)
from tokenbudget.worker.kv_transfer_nixl import NixlKVTransfer
num_blocks, seed, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(seed)
caches = [torch.randn((2, num_blocks, {bs}, {heads}, {head_dim}), generator=g)
          for _ in range({layers})]
before = [t.clone() for t in caches]
receiver = NixlKVTransfer(caches, 0, {bs})
print("HANDSHAKE", base64.b64encode(receiver.handshake()).decode(), flush=True)
sys.stdin.readline()
torch.save({{"before": before, "after": caches}}, path)
receiver.close()
""".format(bs=BS, heads=HEADS, head_dim=HEAD_DIM, layers=LAYERS)


def test_send_into_another_process(transfers, tmp_path):
    path = tmp_path / "caches.pt"
    child = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, "16", "1", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        handshake = next(
            base64.b64decode(line.split()[1])
            for line in child.stdout
            if line.startswith("HANDSHAKE ")
        )
        src = random_caches(12, seed=0)
        sender = transfers(src)
        sender.start(KVConnectorMetadata(sends=[KVSend("r", SRC_IDS, DST_IDS, [handshake])]))
        assert settle(sender) == ({"r"}, {})
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    saved = torch.load(path)
    assert_caches_equal(saved["after"], copied(saved["before"], src, SRC_IDS, DST_IDS))


@pytest.mark.parametrize(
    "receiver_caches, handshakes, reason",
    [
        (lambda: random_caches(16, 1, head_dim=16), None, "head_dim is 8 here, 16 there"),
        (lambda: random_caches(16, 1, dtype=torch.bfloat16), None, "dtype"),
        (lambda: random_caches(16, 1), lambda h: [], "equal tensor-parallel sizes"),
        (lambda: random_caches(8, 1), None, "destination block ids must be in [0, 8)"),
    ],
    ids=["head_dim", "dtype", "no-peer-rank", "dst-out-of-range"],
)
def test_a_send_the_peer_cannot_take_fails_with_a_reason(
    transfers, receiver_caches, handshakes, reason
):
    src, dst = random_caches(12, seed=0), receiver_caches()
    dst_before = [t.clone() for t in dst]
    sender, receiver = transfers(src), transfers(dst)
    peers = [receiver.handshake()] if handshakes is None else handshakes(receiver.handshake())
    sender.start(KVConnectorMetadata(sends=[KVSend("bad", SRC_IDS, DST_IDS, peers)]))
    finished, failed = sender.poll()
    assert finished == set() and list(failed) == ["bad"]
    assert reason in failed["bad"]
    assert_caches_equal(dst, dst_before)


def test_a_cancelled_send_is_reported_once_after_its_write_is_over(transfers, monkeypatch):
    # Over TCP the write is usually still in flight when start() returns.
    monkeypatch.setenv("UCX_TLS", "tcp")
    src, dst = random_caches(200, seed=0), random_caches(220, seed=1)
    ids = list(range(1, 200))
    want = copied(dst, src, ids, ids[::-1])  # no runs: one descriptor per block
    sender, receiver = transfers(src), transfers(dst)
    send = KVSend("r", ids, ids[::-1], [receiver.handshake()])
    sender.start(KVConnectorMetadata(sends=[send], cancels=["r"]))
    # A write in flight is never aborted (bytes on the wire could still land
    # after the peer reused its blocks): it settles, then is reported, once.
    assert settle(sender) == ({"r"}, {})
    assert_caches_equal(dst, want)
    sender.start(KVConnectorMetadata(cancels=["r"]))  # settled already: nothing more
    assert sender.poll() == (set(), {})


def _step(new=(), cached=(), meta=None) -> SchedulerOutput:
    """new: (NewRequestData, tokens to compute); cached: (req_id, num_computed) decoding 1."""
    data = CachedRequestData()
    for rid, computed in cached:
        data.req_ids.append(rid)
        data.new_block_ids.append([])
        data.num_computed_tokens.append(computed)
    num = {n.req_id: k for n, k in new} | {rid: 1 for rid, _ in cached}
    return SchedulerOutput(
        [n for n, _ in new], data, num, sum(num.values()), kv_connector_metadata=meta
    )


def _worker(path: str, num_blocks: int) -> tuple[Worker, list[bytes]]:
    """A worker with its KV registered with NIXL, and its handshakes."""
    worker = Worker(path, dtype="float32", device="cpu", attention_backend="sdpa")
    spec = worker.initialize(
        CacheConfig(block_size=BS, num_blocks=num_blocks, kv_transfer_backend="nixl"),
        SchedulerConfig(max_num_seqs=2, max_model_len=128),
    )
    assert len(spec.kv_transfer_handshakes) == 1
    return worker, list(spec.kv_transfer_handshakes)


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# Negative penalties make a request repeat its outputs: unless the first token
# counts as an output on the decode side too, the two engines differ.
REPEATING = SamplingParams(
    max_tokens=8, temperature=0.0, presence_penalty=-2.0, frequency_penalty=-2.0
)


def _sampled(out, rid: str) -> int:
    return out.sampled_token_ids[out.req_id_to_index[rid]][0]


def test_decode_from_transferred_kv_samples_what_the_prefill_would(tiny_qwen3_path, prompts):
    reqs = {"plain": (prompts[3], GREEDY), "repeating": (prompts[2], REPEATING)}  # 33, 16 tokens
    steps = 5
    (prefill, _), (decode, handshakes) = _worker(tiny_qwen3_path, 40), _worker(tiny_qwen3_path, 60)
    # Blocks for prompt + steps tokens: 10 and 6; the decode's scattered, with runs.
    src = {"plain": list(range(1, 11)), "repeating": list(range(11, 17))}
    dst = {"plain": [50, 51, 52, 30, 31, 7, 8, 9, 44, 20], "repeating": [10, 11, 12, 13, 40, 41]}
    try:
        out = prefill.execute_model(_step(new=[
            (NewRequestData(rid, p, [], sp, src[rid], 0), len(p)) for rid, (p, sp) in reqs.items()
        ]))  # fmt: skip
        want = {rid: [_sampled(out, rid)] for rid in reqs}
        # An engine poll step (nothing scheduled) starts the sends of the
        # prompts' blocks; later ones report them.
        sends = [
            KVSend(rid, src[rid][: -(-len(p) // BS)], dst[rid][: -(-len(p) // BS)], handshakes)
            for rid, (p, _) in reqs.items()
        ]
        out = prefill.execute_model(_step(meta=KVConnectorMetadata(sends=sends)))
        finished, deadline = set(out.finished_sending), time.monotonic() + 10
        while finished != set(reqs) and time.monotonic() < deadline:
            assert not out.failed_sending
            out = prefill.execute_model(_step(meta=KVConnectorMetadata()))
            finished |= out.finished_sending
        assert finished == set(reqs)
        # The oracle: the prefill engine keeps decoding the requests itself.
        for i in range(steps):
            out = prefill.execute_model(
                _step(cached=[(r, len(p) + i) for r, (p, _) in reqs.items()])
            )
            for rid in reqs:
                want[rid].append(_sampled(out, rid))
        # The decode engine gets them as new requests that already have their first token.
        new = [
            (NewRequestData(rid, p, [], sp, dst[rid], len(p), output_token_ids=want[rid][:1]), 1)
            for rid, (p, sp) in reqs.items()
        ]
        out = decode.execute_model(_step(new=new))
        got = {rid: want[rid][:1] + [_sampled(out, rid)] for rid in reqs}
        for i in range(1, steps):
            out = decode.execute_model(
                _step(cached=[(r, len(p) + i) for r, (p, _) in reqs.items()])
            )
            for rid in reqs:
                got[rid].append(_sampled(out, rid))
        assert got == want
        assert len(set(want["plain"])) > 1  # a sequence that depends on the KV
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize(
    "model, cache, error",
    [
        ("sliding", dict(kv_transfer_backend="nixl"), "sliding-window layers"),
        ("qwen3", dict(kv_transfer_backend="nixl", num_offload_blocks=4), "host KV tier"),
    ],
    ids=["sliding-window", "host-tier"],
)
def test_worker_refuses_what_disaggregation_cannot_serve(
    tiny_qwen3_path, tmp_path, model, cache, error
):
    if model == "qwen3":
        path = tiny_qwen3_path
    else:
        from tokenbudget.server.testing.tiny_models import build_tiny_decoder

        path = build_tiny_decoder(
            tmp_path / "mistral", "mistral", seed=2, hidden_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, num_hidden_layers=2,
            sliding_window=20,
        )  # fmt: skip
    worker = Worker(path, dtype="float32", device="cpu", attention_backend="sdpa")
    try:
        with pytest.raises(ValueError, match=error):
            worker.initialize(
                CacheConfig(block_size=BS, num_blocks=16, **cache),
                SchedulerConfig(max_num_seqs=2, max_model_len=64),
            )
    finally:
        worker.shutdown()
