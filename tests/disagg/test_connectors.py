"""The prefill and decode KV connectors against each other over a real
loopback bootstrap listener, their KVConnector methods driven by hand as
the two engines' step threads would. The prefill's workers are a fake that
copies block contents (the oracle: after a transfer the decode's blocks
hold the prompt's KV, its local prefix-hit blocks untouched) and reports
the sends finished, failed, or not yet."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest

from tokenbudget.core.kv.connector import DECODE, PREFILL, KVTransferParams
from tokenbudget.core.request import Request, RequestStatus
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.proto import kv_bootstrap_pb2 as pb
from tokenbudget.proto import kv_bootstrap_pb2_grpc as pb_grpc
from tokenbudget.server.engine.disagg import (
    DecodeConnector,
    DisaggregationConfig,
    PrefillConnector,
    parse_kv_transfer_config,
)

BS = 4
HOST = "127.0.0.1"
FIRST_TOKEN = 42


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _kv(position: int) -> str:
    """What a block of KV holds, in this fake: the positions it covers."""
    return f"kv{position}"


class FakePrefillWorkers:
    """Start the sends each step lists (copying the prefill's block contents
    into the decode's), report them finished the next step unless held."""

    def __init__(self, connector: PrefillConnector, decode_blocks: dict[int, str]) -> None:
        self.connector = connector
        self.prefill_blocks: dict[int, str] = {}
        self.decode_blocks = decode_blocks
        self.sends = []
        self.cancels: list[str] = []
        self.in_flight: dict[str, object] = {}
        self.hold = False
        self.fail: dict[str, str] = {}
        self.freed: list[str] = []

    def step(self) -> None:
        meta = self.connector.build_metadata()
        if meta is not None:
            for send in meta.sends:
                assert len(send.src_block_ids) == len(send.dst_block_ids)
                for src, dst in zip(send.src_block_ids, send.dst_block_ids):
                    self.decode_blocks[dst] = self.prefill_blocks[src]
                self.in_flight[send.request_id] = send
                self.sends.append(send)
            self.cancels += meta.cancels
        finished, failed = set(), {}
        if not self.hold:
            for rid in list(self.in_flight):
                del self.in_flight[rid]
                if rid in self.fail or rid in self.cancels:
                    failed[rid] = self.fail.get(rid, "cancelled")
                else:
                    finished.add(rid)
        self.connector.on_worker_output(finished, failed)
        self.freed += self.connector.take_events().freeable


class NixlPrefillWorkers:
    """The prefill's workers with the real NIXL transfer (worker/kv_transfer_nixl.py)."""

    def __init__(self, connector: PrefillConnector, transfer) -> None:
        self.connector, self.transfer = connector, transfer
        self.freed: list[str] = []

    def step(self) -> None:
        meta = self.connector.build_metadata()
        if meta is not None:
            self.transfer.start(meta)
        self.connector.on_worker_output(*self.transfer.poll())
        self.freed += self.connector.take_events().freeable


class Pair:
    """A prefill and a decode connector, and their engines' step loops."""

    def __init__(self, prefill: PrefillConnector, decode: DecodeConnector) -> None:
        self.prefill, self.decode = prefill, decode
        self.decode_blocks: dict[int, str] = {}
        self.workers = FakePrefillWorkers(prefill, self.decode_blocks)
        self.received: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        self.decode_freed: list[str] = []

    def step(self) -> None:
        self.workers.step()
        events = self.decode.take_events()
        self.received.update(events.received)
        self.failed.update(events.failed)
        self.decode_freed += events.freeable

    def until(self, condition, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < end, "timed out"
            self.step()
            time.sleep(0.005)

    def finish_prefill(self, rid: str, num_tokens: int, room: int, block_ids: list[int]) -> bool:
        """The prefill engine ran the prompt (its blocks hold its KV) and sampled one token."""
        for i, block in enumerate(block_ids):
            self.workers.prefill_blocks[block] = _kv(i * BS)
        req = Request(
            rid,
            list(range(1, num_tokens + 1)),
            SamplingParams(max_tokens=1),
            kv_transfer_params=KVTransferParams(PREFILL, room),
        )
        req.append_output_token_ids([FIRST_TOKEN])
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return self.prefill.request_finished(req, block_ids)

    def decode_request(self, rid: str, num_tokens: int, room: int, port: int = 0) -> Request:
        params = KVTransferParams(DECODE, room, HOST, port or self.prefill.port)
        return Request(
            rid,
            list(range(1, num_tokens + 1)),
            SamplingParams(max_tokens=16),
            kv_transfer_params=params,
        )

    def idle(self) -> bool:
        return not self.prefill.has_pending() and not self.decode.has_pending()


@pytest.fixture
def make_pair():
    made = []

    def make(prefill_timeout=5.0, decode_timeout=5.0, secret=None, decode_secret=None, ranks=1):
        prefill = PrefillConnector(HOST, 0, BS, num_ranks=1, timeout=prefill_timeout, secret=secret)
        made.append(prefill)
        decode = DecodeConnector(
            [b"rank%d" % r for r in range(ranks)],
            BS,
            timeout=decode_timeout,
            secret=secret if decode_secret is None else decode_secret,
        )
        made.append(decode)
        return Pair(prefill, decode)

    yield make
    for connector in made:
        connector.shutdown()


@pytest.mark.parametrize("registration_first", [False, True])
def test_kv_and_first_token_reach_the_decode_in_either_order(make_pair, registration_first):
    pair = make_pair(secret="s3cret")
    dreq = pair.decode_request("r1", 10, room=7)  # 3 blocks, the last one partial
    assert pair.decode.num_remote_tokens(dreq, 0) == 10
    if registration_first:
        pair.decode.on_allocated(dreq, [20, 21, 22], 0)
        pair.until(pair.prefill.has_pending)  # the registration waits for its request
        assert pair.workers.sends == []
    assert pair.finish_prefill("r1", 10, room=7, block_ids=[3, 4, 5]) is True
    if not registration_first:
        pair.decode.on_allocated(dreq, [20, 21, 22], 0)
    pair.until(lambda: "r1" in pair.received)

    assert pair.received == {"r1": FIRST_TOKEN}
    [send] = pair.workers.sends
    assert (send.src_block_ids, send.dst_block_ids) == ([3, 4, 5], [20, 21, 22])
    assert send.peer_handshakes == [b"rank0"]
    assert pair.decode_blocks == {20: _kv(0), 21: _kv(4), 22: _kv(8)}
    pair.until(pair.idle)
    assert pair.workers.freed == ["r1"]
    assert pair.decode.num_remote_tokens(dreq, 0) == 0  # received: nothing more to fetch
    assert pair.decode.request_finished(dreq, [20, 21, 22]) is False  # free at once


def test_a_decode_prefix_hit_transfers_only_the_missing_blocks(make_pair):
    pair = make_pair()
    pair.decode_blocks.update({30: "local0", 31: "local4"})
    dreq = pair.decode_request("r2", 18, room=8)  # 5 blocks, 2 of them local hits
    assert pair.decode.num_remote_tokens(dreq, 8) == 10
    pair.decode.on_allocated(dreq, [30, 31, 32, 33, 34], 8)
    assert pair.decode.blocks_requested == {"r2": 3}
    pair.finish_prefill("r2", 18, room=8, block_ids=[0, 1, 2, 3, 4])
    pair.until(lambda: "r2" in pair.received)

    [send] = pair.workers.sends
    assert (send.src_block_ids, send.dst_block_ids) == ([2, 3, 4], [32, 33, 34])
    assert pair.decode_blocks == {30: "local0", 31: "local4", 32: _kv(8), 33: _kv(12), 34: _kv(16)}
    assert pair.decode.stats["blocks_requested"] == 3
    pair.until(pair.idle)


def test_a_whole_prompt_hit_fetches_only_the_first_token(make_pair):
    pair = make_pair()
    assert pair.finish_prefill("r3", 8, room=9, block_ids=[1, 2]) is True
    dreq = pair.decode_request("r3", 8, room=9)
    # The scheduler caps a whole-prompt hit one token short; its blocks are full and local.
    assert pair.decode.num_remote_tokens(dreq, 7) == 1
    pair.decode.on_allocated(dreq, [40, 41], 7)
    assert pair.decode.blocks_requested == {"r3": 0}
    pair.until(lambda: "r3" in pair.received)
    assert pair.received["r3"] == FIRST_TOKEN and pair.workers.sends == []
    pair.until(pair.idle)
    assert pair.workers.freed == ["r3"]


def test_allocations_the_decode_cannot_fetch_into_fail_the_request(make_pair):
    pair = make_pair()
    pair.decode.on_allocated(pair.decode_request("r17", 18, room=24), [0, 1, 2, 3, 4], 6)
    pair.decode.on_allocated(pair.decode_request("r18", 18, room=25), [0, 1, 2, 3], 0)
    pair.until(lambda: len(pair.failed) == 2)
    assert pair.failed == {
        "r17": "cannot fetch its KV: 6 local tokens is not whole blocks of 4 (prompt of 18)",
        "r18": "cannot fetch its KV: 4 blocks cannot hold a 18-token prompt",
    }
    pair.until(pair.idle)


def test_the_decode_fails_clearly_when_no_prefill_listens(make_pair):
    pair = make_pair()
    port = _free_port()
    dreq = pair.decode_request("r4", 4, room=11, port=port)
    pair.decode.on_allocated(dreq, [0], 0)
    pair.until(lambda: "r4" in pair.failed)
    message = pair.failed["r4"]
    assert f"prefill {HOST}:{port}, room 11" in message and "unreachable" in message
    # Unanswered: the blocks free once the (unreachable) prefill cannot be asked.
    assert pair.decode.request_finished(dreq, [0]) is True
    pair.until(lambda: pair.decode_freed == ["r4"])
    pair.until(pair.idle)


def test_the_decode_deadline_expires_when_the_prefill_never_finishes(make_pair):
    pair = make_pair(decode_timeout=0.3)
    dreq = pair.decode_request("r5", 4, room=12)
    pair.decode.on_allocated(dreq, [0], 0)
    start = time.monotonic()
    pair.until(lambda: "r5" in pair.failed)
    assert time.monotonic() - start >= 0.25
    assert pair.failed["r5"] == (
        f"no KV from prefill {HOST}:{pair.prefill.port}, room 12 within 0.3 s "
        "(--disaggregation-timeout)"
    )
    assert pair.received == {}
    # No answer from the prefill: its blocks wait for its Cancel (which finds nothing).
    assert pair.decode.request_finished(dreq, [0]) is True
    pair.until(lambda: pair.decode_freed == ["r5"])
    pair.until(pair.idle)
    # The room is done with on the prefill: its request, finishing late, frees at once.
    assert pair.finish_prefill("r5", 4, room=12, block_ids=[1]) is False


def test_the_prefill_frees_a_finished_request_no_decode_registered_for(make_pair):
    pair = make_pair(prefill_timeout=0.3)
    assert pair.finish_prefill("r6", 8, room=13, block_ids=[5, 6]) is True
    pair.step()
    assert pair.workers.freed == [] and pair.prefill.has_pending()
    pair.until(lambda: pair.workers.freed == ["r6"])
    assert pair.prefill.stats["expired"] == 1
    # The decode that registers late is told at once.
    pair.decode.on_allocated(pair.decode_request("r6", 8, room=13), [0, 1], 0)
    pair.until(lambda: "r6" in pair.failed)
    assert "room 13 was already served, cancelled or expired" in pair.failed["r6"]
    pair.until(pair.idle)


def test_a_registration_whose_request_never_comes_is_answered_with_an_error(make_pair):
    pair = make_pair(prefill_timeout=0.3)
    pair.decode.on_allocated(pair.decode_request("r7", 4, room=14), [0], 0)
    pair.until(lambda: "r7" in pair.failed)
    assert "no prefill request for room 14 finished within 0.3 s" in pair.failed["r7"]
    pair.until(pair.idle)


def test_a_decode_abort_mid_transfer_frees_only_after_the_prefill_stops_writing(make_pair):
    pair = make_pair()
    pair.workers.hold = True  # the send stays in flight until released
    dreq = pair.decode_request("r8", 8, room=15)
    pair.decode.on_allocated(dreq, [50, 51], 0)
    assert pair.finish_prefill("r8", 8, room=15, block_ids=[7, 8]) is True
    pair.until(lambda: "r8" in pair.workers.in_flight)

    assert pair.decode.request_finished(dreq, [50, 51]) is True  # blocks held
    pair.until(lambda: pair.workers.cancels == ["r8"])  # the stream's end cancels the send
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # the prefill's Cancel waits for the workers
        pair.step()
        time.sleep(0.01)
    assert pair.decode_freed == [] and pair.workers.freed == []
    assert pair.decode.has_pending()

    pair.workers.hold = False  # the workers report the cancelled send
    pair.until(lambda: pair.decode_freed == ["r8"])
    assert pair.workers.freed == ["r8"]
    assert pair.received == {} and pair.failed == {}
    pair.until(pair.idle)


def test_a_prefill_abort_fails_the_decode(make_pair):
    pair = make_pair()
    pair.decode.on_allocated(pair.decode_request("r9", 8, room=16), [0, 1], 0)
    pair.until(pair.prefill.has_pending)
    preq = Request(
        "r9",
        list(range(1, 9)),
        SamplingParams(max_tokens=1),
        kv_transfer_params=KVTransferParams(PREFILL, 16),
    )
    preq.status = RequestStatus.FINISHED_ABORTED
    assert pair.prefill.request_finished(preq, [3, 4]) is False  # nothing was sent: free now
    pair.until(lambda: "r9" in pair.failed)
    assert "prefill request r9 ended (abort) before its KV" in pair.failed["r9"]
    assert pair.workers.sends == []
    pair.until(pair.idle)


def test_a_failed_send_fails_the_decode_and_frees_the_prefill(make_pair):
    pair = make_pair()
    pair.workers.fail["r10"] = "layout mismatch: dtype"
    pair.decode.on_allocated(pair.decode_request("r10", 4, room=17), [0], 0)
    pair.finish_prefill("r10", 4, room=17, block_ids=[2])
    pair.until(lambda: "r10" in pair.failed)
    assert "the prefill's KV send failed: layout mismatch: dtype" in pair.failed["r10"]
    pair.until(pair.idle)
    assert pair.workers.freed == ["r10"]


def test_unequal_tp_sizes_are_refused_at_registration(make_pair):
    pair = make_pair(ranks=2)
    pair.decode.on_allocated(pair.decode_request("r11", 4, room=18), [0], 0)
    pair.until(lambda: "r11" in pair.failed)
    assert "the decode has 2 TP ranks and this prefill 1" in pair.failed["r11"]
    # The room is done with: the prefill's request, when it finishes, is freed at once.
    assert pair.finish_prefill("r11", 4, room=18, block_ids=[2]) is False
    pair.until(pair.idle)


def test_differing_block_sizes_are_refused_at_registration(make_pair):
    pair = make_pair()
    pair.decode.block_size = 8  # as if started with another --block-size
    pair.decode.on_allocated(pair.decode_request("r14", 8, room=21), [0], 0)
    pair.until(lambda: "r14" in pair.failed)
    assert "the decode's KV blocks hold 8 tokens and this prefill's 4" in pair.failed["r14"]


def test_same_length_prompts_with_different_tokens_are_refused(make_pair):
    pair = make_pair()
    dreq = pair.decode_request("r15", 8, room=22)
    dreq.prompt_token_ids[3] = 99  # tokenized differently
    pair.decode.on_allocated(dreq, [0, 1], 0)
    pair.until(pair.prefill.has_pending)
    assert pair.finish_prefill("r15", 8, room=22, block_ids=[2, 3]) is False
    pair.until(lambda: "r15" in pair.failed)
    assert "the prompts of room 22 differ in their tokens" in pair.failed["r15"]
    assert pair.workers.sends == []


def test_differing_prompt_lengths_are_refused(make_pair):
    pair = make_pair()
    pair.decode.on_allocated(pair.decode_request("r12", 8, room=19), [0, 1], 0)
    pair.until(pair.prefill.has_pending)
    assert pair.finish_prefill("r12", 7, room=19, block_ids=[2, 3]) is False
    pair.until(lambda: "r12" in pair.failed)
    assert "prompt lengths differ" in pair.failed["r12"]


# A well-formed registration (the tests change one field).
VALID = dict(
    room=2,
    request_id="x",
    handshakes=[b"h"],
    dst_block_ids=[0],
    num_prompt_tokens=4,
    block_size=BS,
    prompt_digest=bytes(32),
)


def _register(port: int, request: pb.RegisterRequest, metadata=()) -> list:
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        stub = pb_grpc.KVBootstrapStub(channel)
        return list(stub.Register(request, timeout=5, metadata=metadata))


def test_a_registration_without_the_secret_is_unauthenticated(make_pair):
    pair = make_pair(secret="s3cret", decode_secret="wrong")
    with pytest.raises(grpc.RpcError) as info:
        _register(pair.prefill.port, pb.RegisterRequest(**VALID))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "--worker-secret-file" in info.value.details()
    pair.decode.on_allocated(pair.decode_request("r13", 4, room=20), [0], 0)
    pair.until(lambda: "r13" in pair.failed)
    assert "refused the registration: UNAUTHENTICATED" in pair.failed["r13"]
    assert not pair.prefill.has_pending()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"handshakes": [b"h"] * 65}, "handshakes"),
        ({"handshakes": []}, "handshakes"),
        ({"handshakes": [b"h" * ((4 << 20) + 1)]}, "handshakes[0]"),
        ({"dst_block_ids": [0] * ((1 << 20) + 1)}, "dst_block_ids"),
        ({"dst_block_ids": [-1]}, "dst_block_ids"),
        ({"request_id": ""}, "request_id"),
        ({"skip_tokens": 8}, "skip_tokens"),
        ({"num_prompt_tokens": 0}, "num_prompt_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"prompt_digest": b"x"}, "prompt_digest"),
    ],
)
def test_malformed_registrations_are_invalid_arguments(make_pair, change, field):
    pair = make_pair()
    with pytest.raises(grpc.RpcError) as info:
        _register(pair.prefill.port, pb.RegisterRequest(**{**VALID, **change}))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field)
    assert not pair.prefill.has_pending()


def test_the_kv_transfer_config_maps_to_a_mode_and_disagreements_are_refused():
    producer = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    config = DisaggregationConfig(kv_transfer_config=parse_kv_transfer_config(producer))
    assert (config.mode, config.transfer_backend, config.enabled) == ("prefill", "nixl", True)
    assert DisaggregationConfig().mode == "null"
    consumer = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}
    config = DisaggregationConfig(disaggregation_mode="decode", kv_transfer_config=consumer)
    assert (config.mode, config.transfer_backend) == ("decode", "mooncake")
    refusals = [
        (dict(disaggregation_mode="decode", kv_transfer_config=producer), "disagrees with"),
        (dict(disaggregation_mode="both"), "--disaggregation-mode must be"),
        (dict(disaggregation_bootstrap_port=0), "--disaggregation-bootstrap-port"),
        (dict(disaggregation_bootstrap_port=65536), "--disaggregation-bootstrap-port"),
        (dict(disaggregation_timeout=0), "--disaggregation-timeout"),
        (dict(disaggregation_timeout=float("nan")), "--disaggregation-timeout"),
        (
            dict(
                disaggregation_transfer_backend="mooncake",
                kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
            ),
            "kv_connector 'NixlConnector' disagrees with --disaggregation-transfer-backend",
        ),
        (
            dict(kv_transfer_config='{"kv_role": "kv_both", "kv_connector": "NixlConnector"}'),
            "kv_both",
        ),
        (dict(kv_transfer_config='{"kv_connector": "P2pNcclConnector"}'), "kv_connector"),
        (dict(kv_transfer_config='{"kv_connecter": "NixlConnector"}'), "unknown key"),
        (dict(kv_transfer_config="[1]"), "JSON object"),
        (dict(kv_transfer_config="{"), "not JSON"),
    ]
    engine_args = SimpleNamespace(
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=9000,
        disaggregation_transfer_backend="nixl",
        disaggregation_timeout=2.5,
        kv_transfer_config=None,
        model="m",
    )
    config = DisaggregationConfig.of(engine_args)
    assert (config.mode, config.disaggregation_bootstrap_port) == ("prefill", 9000)
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")) as info:
            DisaggregationConfig(**kwargs)
        assert "\n" not in str(info.value)


def test_real_nixl_writes_only_the_missing_blocks_between_the_connectors():
    """The same flow with the workers' real NIXL transfer (two agents over
    UCX), in a child process: NIXL's bundled libraries and grpc_tools' protoc
    (tests/grpc/test_proto.py) crash when loaded into one process."""
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('connectors', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.real_nixl_scenario()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, __file__], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


def real_nixl_scenario() -> None:
    """The decode's cache ends up with the prefill's blocks for the tokens it
    lacked, its prefix-hit blocks and the rest untouched."""
    import torch

    from tokenbudget.worker.kv_transfer_nixl import NixlKVTransfer

    torch.set_num_threads(1)

    def caches(seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        return [torch.randn((2, 12, BS, 2, 8), generator=g) for _ in range(2)]

    prefill_kv, decode_kv = caches(0), caches(1)
    decode_before = [t.clone() for t in decode_kv]
    sender, receiver = NixlKVTransfer(prefill_kv, 0, BS), NixlKVTransfer(decode_kv, 0, BS)
    prefill = PrefillConnector(HOST, 0, BS, num_ranks=1)
    decode = DecodeConnector([receiver.handshake()], BS)
    try:
        pair = Pair(prefill, decode)
        dreq = pair.decode_request("r16", 18, room=23)  # 5 blocks, 2 local hits
        decode.on_allocated(dreq, [0, 1, 6, 7, 3], 8)
        pair.finish_prefill("r16", 18, room=23, block_ids=[2, 3, 4, 5, 10])
        pair.workers = NixlPrefillWorkers(prefill, sender)  # instead of the fake
        pair.until(lambda: "r16" in pair.received or "r16" in pair.failed, timeout=15)
        assert pair.received == {"r16": FIRST_TOKEN}, pair.failed
        want = [t.clone() for t in decode_before]
        for w, src in zip(want, prefill_kv):
            w[:, [6, 7, 3]] = src[:, [4, 5, 10]]
        for got, expected in zip(decode_kv, want):
            assert torch.equal(got, expected)
        pair.until(pair.idle)
        assert pair.workers.freed == ["r16"]
    finally:
        prefill.shutdown()
        decode.shutdown()
        sender.close()
        receiver.close()


@pytest.mark.parametrize("when", ["before-registration", "sending"])
def test_aborting_a_finished_prefill_request_stops_its_send_and_fails_the_decode(make_pair, when):
    """The gateway aborts both halves when its client goes away; the prefill's
    request already finished and its blocks are held for the decode."""
    pair = make_pair()
    pair.workers.hold = True  # a send stays in flight until released
    dreq = pair.decode_request("r20", 8, room=40)
    assert pair.finish_prefill("r20", 8, room=40, block_ids=[7, 8]) is True
    if when == "sending":
        pair.decode.on_allocated(dreq, [50, 51], 0)
        pair.until(lambda: "r20" in pair.workers.in_flight)
    pair.prefill.abort_finished("r20")
    if when == "sending":
        pair.until(lambda: pair.workers.cancels == ["r20"])
        assert pair.workers.freed == []  # the write in flight still reads the blocks
        pair.workers.hold = False
    else:  # its decode registers late: refused, nothing is sent
        pair.decode.on_allocated(dreq, [50, 51], 0)
    pair.until(lambda: "r20" in pair.failed)
    pair.until(lambda: pair.workers.freed == ["r20"])
    assert "r20" not in pair.received
    pair.prefill.abort_finished("r20")  # idempotent
    pair.until(pair.idle)
    assert pair.workers.freed == ["r20"]
