"""KV transfer for disaggregated prefill/decode with Mooncake
(worker/kv_transfer_mooncake.py), with the real transfer engine over TCP on
loopback: the same cases as NIXL's (test_kv_transfer_nixl.py) — exact blocks
in few descriptors, into another process that runs no code meanwhile, a peer
that cannot take the send fails it with a reason, cancels settle once — and a
decode engine continuing from Mooncake-transferred KV samples what the
prefill engine itself would have. Skipped where Mooncake (or the system's
libibverbs it loads) is missing."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
import torch

# Runs in a pytest process of its own (test_kv_transfers_in_own_process.py).
if os.environ.get("TOKENBUDGET_TRANSFER_TESTS") != "mooncake":
    pytest.skip("runs in its own process", allow_module_level=True)
pytest.importorskip("mooncake.engine", exc_type=ImportError)

from tests.worker.test_kv_transfer_nixl import (  # noqa: E402 (after the skip)
    BS,
    DST_IDS,
    GREEDY,
    HEAD_DIM,
    HEADS,
    LAYERS,
    REPEATING,
    SRC_IDS,
    _sampled,
    _step,
    assert_caches_equal,
    copied,
    random_caches,
    settle,
)
from tokenbudget.core import CacheConfig, NewRequestData, SchedulerConfig  # noqa: E402
from tokenbudget.core.kv.connector import KVConnectorMetadata, KVSend  # noqa: E402
from tokenbudget.worker.kv_transfer_mooncake import MooncakeKVTransfer  # noqa: E402
from tokenbudget.worker.worker import Worker  # noqa: E402

LOOPBACK = "127.0.0.1"


@pytest.fixture
def transfers():
    """Make rank-0 MooncakeKVTransfers on loopback, closed after the test."""
    made: list[MooncakeKVTransfer] = []

    def make(caches) -> MooncakeKVTransfer:
        made.append(MooncakeKVTransfer(caches, 0, BS, hostname=LOOPBACK))
        return made[-1]

    yield make
    for t in made:
        t.close()


def test_send_writes_exactly_its_blocks_in_few_descriptors(transfers):
    src, dst = random_caches(12, seed=0), random_caches(16, seed=1)
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
    sender.start(KVConnectorMetadata(sends=[KVSend("empty", [], [], [receiver.handshake()])]))
    assert sender.poll() == ({"empty"}, {})
    assert sender.num_descriptors == 2 * 2 * LAYERS


# The receiving process: registers its cache, hands out its handshake, then
# runs nothing but a blocking read until the sender is done.
_RECEIVER = """
import base64, sys, torch
torch.set_num_threads(1)
from tokenbudget.worker.kv_transfer_mooncake import MooncakeKVTransfer
num_blocks, seed, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(seed)
caches = [torch.randn((2, num_blocks, {bs}, {heads}, {head_dim}), generator=g)
          for _ in range({layers})]
before = [t.clone() for t in caches]
receiver = MooncakeKVTransfer(caches, 0, {bs}, hostname="{host}")
print("HANDSHAKE", base64.b64encode(receiver.handshake()).decode(), flush=True)
sys.stdin.readline()
torch.save({{"before": before, "after": caches}}, path)
receiver.close()
""".format(bs=BS, heads=HEADS, head_dim=HEAD_DIM, layers=LAYERS, host=LOOPBACK)


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


def test_a_send_to_a_peer_that_died_fails_rather_than_hangs(transfers, tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, "16", "1", str(tmp_path / "caches.pt")],
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
        sender = transfers(random_caches(12, seed=0))
        send = KVSend("before", SRC_IDS, DST_IDS, [handshake])
        sender.start(KVConnectorMetadata(sends=[send]))
        assert settle(sender) == ({"before"}, {})  # connected: the peer's segment is cached
    finally:
        child.kill()
        child.wait()
    sender.start(KVConnectorMetadata(sends=[KVSend("after", SRC_IDS, DST_IDS, [handshake])]))
    finished, failed = settle(sender, timeout_s=60)
    assert finished == set() and list(failed) == ["after"]


def _nixl_handshake(caches) -> list[bytes]:
    """A NIXL engine's handshake (same layout, another backend), built without
    loading NIXL in this process."""
    engine = MooncakeKVTransfer(caches, 0, BS, hostname=LOOPBACK)
    try:
        info = json.loads(engine.handshake())
    finally:
        engine.close()
    info.update(backend="nixl", agent="a-nixl-agent", metadata="")
    return [json.dumps(info).encode()]


def _gone_peer(caches) -> list[bytes]:
    """A handshake whose engine has shut down: nothing listens at its session."""
    gone = MooncakeKVTransfer(caches, 0, BS, hostname=LOOPBACK)
    raw = gone.handshake()
    gone.close()
    return [raw]


@pytest.mark.parametrize(
    "receiver_caches, handshakes, reason",
    [
        (lambda: random_caches(16, 1, head_dim=16), None, "head_dim is 8 here, 16 there"),
        (lambda: random_caches(16, 1, dtype=torch.bfloat16), None, "dtype"),
        (lambda: random_caches(16, 1), lambda h, c: [], "equal tensor-parallel sizes"),
        (lambda: random_caches(8, 1), None, "destination block ids must be in [0, 8)"),
        (lambda: random_caches(16, 1), lambda h, c: _nixl_handshake(c), "moves KV with nixl"),
        (lambda: random_caches(16, 1), lambda h, c: [b"{"], "handshake is not valid"),
        (lambda: random_caches(16, 1), lambda h, c: _gone_peer(c), "could not start the KV"),
    ],
    ids=["head_dim", "dtype", "no-peer-rank", "dst-out-of-range", "nixl-peer", "garbage",
         "peer-gone"],
)  # fmt: skip
def test_a_send_the_peer_cannot_take_fails_with_a_reason(
    transfers, receiver_caches, handshakes, reason
):
    src, dst = random_caches(12, seed=0), receiver_caches()
    dst_before = [t.clone() for t in dst]
    sender, receiver = transfers(src), transfers(dst)
    h = receiver.handshake()
    peers = [h] if handshakes is None else handshakes(h, dst)
    sender.start(KVConnectorMetadata(sends=[KVSend("bad", SRC_IDS, DST_IDS, peers)]))
    finished, failed = settle(sender)
    assert finished == set() and list(failed) == ["bad"]
    assert reason in failed["bad"]
    assert_caches_equal(dst, dst_before)


def test_a_cancelled_send_is_reported_once_after_its_write_is_over(transfers):
    # 4,794 descriptors, submitted one batch each at once: Mooncake's queue per
    # peer (default 1,024) would reject some; MooncakeKVTransfer raises it.
    src, dst = random_caches(810, seed=0), random_caches(820, seed=1)
    ids = list(range(1, 800))
    want = copied(dst, src, ids, ids[::-1])  # no runs: one descriptor per block
    sender, receiver = transfers(src), transfers(dst)
    send = KVSend("r", ids, ids[::-1], [receiver.handshake()])
    sender.start(KVConnectorMetadata(sends=[send], cancels=["r"]))
    # Mooncake cannot abort a write: it settles, then is reported, once.
    assert settle(sender) == ({"r"}, {})
    assert sender.num_descriptors == len(ids) * 2 * LAYERS
    assert_caches_equal(dst, want)
    sender.start(KVConnectorMetadata(cancels=["r"]))  # settled already: nothing more
    assert sender.poll() == (set(), {})


@pytest.mark.xfail(
    reason="Mooncake 0.3.13: with a tiny per-peer queue some rejected writes never report a "
    "status, so the send never settles (seen on a loaded 2-core machine); the backend sets "
    "the queue to 65535 unless the user chose one",
    strict=False,
)
def test_a_send_partly_rejected_fails_once_every_write_settled(transfers, monkeypatch):
    # A queue of 8 descriptors per peer: most of the 1,194 are rejected, the
    # first ones write; the send is reported failed once, after all settled.
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "8")
    src, dst = random_caches(200, seed=0), random_caches(220, seed=1)
    ids = list(range(1, 200))
    sender, receiver = transfers(src), transfers(dst)
    sender.start(KVConnectorMetadata(sends=[KVSend("r", ids, ids[::-1], [receiver.handshake()])]))
    finished, failed = settle(sender, timeout_s=3.0)
    assert finished == set() and failed == {"r": "Mooncake failed to write the KV to the peer"}
    assert not sender._inflight
    assert sender.poll() == (set(), {})


def test_importing_the_worker_imports_no_transfer_library():
    code = "import sys, tokenbudget.worker.worker; print(sorted({'mooncake', 'nixl'} & {m.split('.')[0] for m in sys.modules}))"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _worker(path: str, num_blocks: int, monkeypatch) -> tuple[Worker, list[bytes]]:
    """A worker with its KV registered with Mooncake (on loopback), and its handshakes."""
    monkeypatch.setattr(
        "tokenbudget.worker.kv_transfer_mooncake._outbound_address", lambda: LOOPBACK
    )
    worker = Worker(path, dtype="float32", device="cpu", attention_backend="sdpa")
    spec = worker.initialize(
        CacheConfig(block_size=BS, num_blocks=num_blocks, kv_transfer_backend="mooncake"),
        SchedulerConfig(max_num_seqs=2, max_model_len=128),
    )
    assert isinstance(worker.kv_transfer, MooncakeKVTransfer)
    assert len(spec.kv_transfer_handshakes) == 1
    return worker, list(spec.kv_transfer_handshakes)


def test_decode_from_transferred_kv_samples_what_the_prefill_would(
    tiny_qwen3_path, prompts, monkeypatch
):
    reqs = {"plain": (prompts[3], GREEDY), "repeating": (prompts[2], REPEATING)}  # 33, 16 tokens
    steps = 5
    prefill, _ = _worker(tiny_qwen3_path, 40, monkeypatch)
    decode, handshakes = _worker(tiny_qwen3_path, 60, monkeypatch)
    src = {"plain": list(range(1, 11)), "repeating": list(range(11, 17))}
    dst = {"plain": [50, 51, 52, 30, 31, 7, 8, 9, 44, 20], "repeating": [10, 11, 12, 13, 40, 41]}
    try:
        out = prefill.execute_model(_step(new=[
            (NewRequestData(rid, p, [], sp, src[rid], 0), len(p)) for rid, (p, sp) in reqs.items()
        ]))  # fmt: skip
        want = {rid: [_sampled(out, rid)] for rid in reqs}
        sends = [
            KVSend(rid, src[rid][: -(-len(p) // BS)], dst[rid][: -(-len(p) // BS)], handshakes)
            for rid, (p, _) in reqs.items()
        ]
        out = prefill.execute_model(_step(meta=KVConnectorMetadata(sends=sends)))
        finished = set(out.finished_sending)
        for _ in range(10_000):
            if finished == set(reqs):
                break
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
