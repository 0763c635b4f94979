"""One client cannot hurt the others (issue 26, items 5-12), against real
processes: the sockets a tensor-parallel group opens, a worker's
Initialize that names its bad field, and the hang bound that tightens once
a worker has answered.

The bad-input kinds of these items (request_id, tenant, cache_salt, the
constraints that leave no token, gateway logit_bias keys) are rows of
test_bad_inputs.py; the hung worker found in seconds is
test_worker_faults.py's SIGSTOP test (its server keeps the 300 s first-step
allowance); an unkeyed flood of 60 MB calls and the request id sent once
per stream are test_public_port.py's (before its SIGTERM test stops the
public server).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.proto import convert, worker_pb2, worker_pb2_grpc
from tokenbudget.proto.rpc.auth import bearer_metadata
from tokenbudget.server.entrypoints.client import Client

from .conftest import PROBE


# -- sockets -------------------------------------------------------------------------------
def _listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in the processes ``pids``
    (Linux /proc: a socket's inode links its fd to its row in /proc/net/tcp*)."""
    import ipaddress

    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp to read listening sockets from")
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = fd.readlink().name
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            found.add((str(getattr(ip, "ipv4_mapped", None) or ip), int(hex_port, 16)))
    return found


def test_a_tensor_parallel_group_listens_on_loopback_only():
    """--tensor-parallel-size N: the rank processes' gRPC port, the rendezvous
    store and gloo's connections all listen on 127.0.0.1 (torch's tcp://
    store alone would listen on every interface)."""
    from tokenbudget.server.executor.tensor_parallel import LocalRanks

    ranks = LocalRanks(2, dist_timeout_s=30.0)
    try:
        sockets = _listening([p.pid for p in ranks.procs])
        rank0_port = int(ranks.address.rsplit(":", 1)[1])
        assert ("127.0.0.1", rank0_port) in sockets
        assert len(sockets) >= 3, sockets  # gRPC, the store, gloo
        assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets
    finally:
        ranks.stop()


# -- a worker's Initialize -----------------------------------------------------------------
def test_a_worker_refuses_block_size_0_naming_the_field_and_keeps_serving(faults):
    request = worker_pb2.InitializeRequest(model=faults.model, dtype="float32", device="cpu")
    convert.configs_to_proto(
        CacheConfig(block_size=16, num_blocks=8), SchedulerConfig(max_model_len=64), request
    )
    request.cache_config.block_size = 0
    secret = faults.secret_file.read_text().strip()
    with grpc.insecure_channel(f"127.0.0.1:{faults.worker_port}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerStub(ch).Initialize(
                request, metadata=bearer_metadata(secret), timeout=30
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_config.block_size must be >= 1, got 0" in err.value.details()
    with Client(faults.remote.address) as c:  # the worker still serves its server
        got = c.generate(PROBE, max_tokens=4, temperature=0, ignore_eos=True)
        assert got.token_ids == faults.reference[:4]


# -- the hang bound ------------------------------------------------------------------------
def test_the_hang_bound_tightens_once_a_worker_has_answered_steps():
    """The first steps get --worker-step-timeout (lazy set-up); after two
    answers, --worker-hang-timeout or 20x the slowest answered step after the
    first, whichever is longer, never past --worker-step-timeout."""
    from types import SimpleNamespace

    from tokenbudget.server.executor.remote import RemoteExecutor, _Connection

    executor = RemoteExecutor(["127.0.0.1:1"], "unused", step_timeout=300.0, hang_timeout=3.0)
    conn = SimpleNamespace(answered=0, slowest=0.0, waiting_since=0.0)  # a connection's clock

    def answer(at: float) -> float:
        _Connection.answer(conn, at)
        return executor.step_bound(conn)[0]

    assert executor.step_bound(conn) == (300.0, "--worker-step-timeout=300 s")
    assert answer(120.0) == 300.0  # the first step: slow set-up, not a sample
    assert answer(120.01) == 3.0
    assert executor.step_bound(conn)[1] == "--worker-hang-timeout=3 s"
    assert answer(120.51) == pytest.approx(10.0)  # a 0.5 s step: 20x is 10 s
    assert answer(140.51) == 300.0  # a 20 s step: 20x is past the step timeout
