"""The host KV tier and KV cache events through a real `server` driving a real
worker process: swap copies cross the worker protocol (nothing recomputed,
tokens equal the in-process oracle's), and the SubscribeKvEvents stream
replays, without a gap, to the state a fresh subscriber's snapshot shows."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenbudget.core import CacheConfig, SamplingParams, SchedulerConfig
from tokenbudget.core.kv.events import DEVICE, HOST, KVEventReplayer
from tokenbudget.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenbudget.proto import convert, step_stream, worker_pb2
from tokenbudget.server.entrypoints.client import Client

BIN = Path(sys.executable).parent
GREEDY_40 = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def tiered_server(tiny_model, tmp_path_factory):
    """A server with 20 device blocks, a 64-block host tier and KV events, on a
    worker in its own process."""
    logs = tmp_path_factory.mktemp("tiered")
    worker_port, port = _free_port(), _free_port()
    procs = [
        _spawn(
            [
                sys.executable,
                "-m",
                "tokenbudget.worker",
                "--host",
                "127.0.0.1",
                "--port",
                str(worker_port),
                "--threads",
                "1",
            ],
            logs / "worker.log",
        ),
        _spawn(
            [
                str(BIN / "server"),
                "--model",
                tiny_model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--torch-threads",
                "1",
                "--worker",
                f"127.0.0.1:{worker_port}",
                "--num-gpu-blocks",
                "20",
                "--num-offload-blocks",
                "64",
                "--enable-kv-cache-events",
                "--max-num-batched-tokens",
                "64",
            ],
            logs / "server.log",
        ),
    ]
    client = Client(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                client.model_info()
                break
            except grpc.RpcError:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(
                        "the tiered server did not start:\n"
                        + "\n".join(f.read_text()[-3000:] for f in logs.iterdir())
                    )
                time.sleep(0.3)
        yield client
    finally:
        client.close()
        for p in reversed(procs):
            p.kill()
            p.wait(10)


def test_swap_crosses_the_worker_protocol_and_events_replay_without_a_gap(tiered_server, oracle):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 1000, size=60).tolist() for _ in range(4)]
    replayer = KVEventReplayer()
    stream = tiered_server.subscribe_kv_events()
    failures: list[BaseException] = []

    def follow() -> None:
        try:
            for batch in stream:
                replayer.apply(batch)  # raises KVEventGap on a missing batch
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                failures.append(exc)
        except BaseException as exc:
            failures.append(exc)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda p: tiered_server.generate({"token_ids": p}, GREEDY_40), prompts)
        )
    expected = oracle.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_40)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    stats = tiered_server.stats()
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens == 0
    assert stats.kv_swap_out_blocks > 0 and stats.kv_swap_in_blocks > 0
    assert stats.num_offload_blocks == 64 and stats.num_swapped_requests == 0

    # The engine is idle: a new subscriber's snapshot is the final state.
    second = tiered_server.subscribe_kv_events()
    snapshot = next(iter(second))
    second.cancel()
    assert snapshot.snapshot and snapshot.num_dropped == 0
    deadline = time.monotonic() + 10
    while (replayer.last_seq or 0) < snapshot.seq and time.monotonic() < deadline:
        time.sleep(0.05)
    stream.cancel()
    reader.join(10)
    assert not failures, failures
    assert replayer.last_seq == snapshot.seq
    rebuilt = KVEventReplayer()
    rebuilt.apply(snapshot)
    assert replayer.tiers == rebuilt.tiers
    assert replayer.tiers[DEVICE] and replayer.tiers[HOST]


def test_a_negative_max_pending_is_invalid_argument(tiered_server):
    with pytest.raises(grpc.RpcError) as info:
        next(iter(tiered_server.subscribe_kv_events(max_pending=-1)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_pending" in info.value.details()


def test_kv_copies_and_tier_settings_cross_the_worker_protocol():
    cache = CacheConfig(
        block_size=8,
        num_blocks=100,
        kv_offload_memory_bytes=1 << 30,
        num_offload_blocks=77,
        kv_load_blocks_per_step=5,
        enable_kv_cache_events=True,
    )
    msg = worker_pb2.InitializeRequest(model="m")
    convert.configs_to_proto(cache, SchedulerConfig(), msg)
    assert convert.configs_from_proto(msg)[0] == cache

    encoder, decoder = step_stream.SchedulerOutputEncoder(), step_stream.SchedulerOutputDecoder()

    def send(so: SchedulerOutput) -> tuple[worker_pb2.SchedulerOutput, SchedulerOutput]:
        wire = worker_pb2.SchedulerOutput.FromString(encoder.encode(so).SerializeToString())
        return wire, decoder.decode(wire)

    first = SchedulerOutput(
        [NewRequestData("a", [1, 2], [], SamplingParams(), [1], 0)],
        CachedRequestData(),
        {"a": 2},
        2,
    )
    send(first)
    steady = SchedulerOutput([], CachedRequestData(["a"], [[]], [2]), {"a": 1}, 1)
    send(steady)
    # The same requests and counts again, but with copies: not a bare repeat.
    copies = SchedulerOutput(
        [],
        CachedRequestData(["a"], [[]], [3]),
        {"a": 1},
        1,
        kv_swap_out=[(5, 0), (9, 3)],
        kv_swap_in=[(2, 7)],
    )
    wire, back = send(copies)
    assert not wire.repeats_last_step
    assert back.kv_swap_out == [(5, 0), (9, 3)] and back.kv_swap_in == [(2, 7)]
    assert back.num_scheduled_tokens == {"a": 1}
