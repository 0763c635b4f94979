"""The public port under attack and under load: TLS, mutual TLS and the API
key (refused on metadata, before a large message is read); the request id
sent once per stream; a flood beyond --max-concurrent-rpcs and --max-queued-requests answered
at once while health, stats and model info still answer; many streams
cancelled at once; tenants' prefix caches kept apart by cache_salt; and, last
(it stops the server), SIGTERM mid-stream draining every stream.

After each fault the server has no request left and every KV block free.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pathlib import Path

from tokenbudget.proto import generate_pb2, generate_pb2_grpc
from tokenbudget.proto.rpc.auth import bearer_metadata
from tokenbudget.server.entrypoints.client import Client

from .conftest import API_KEY, MAX_QUEUED, MAX_RPCS, MAX_SEQS, PROBE, assert_idle, health, wait_idle

SERVING = health_pb2.HealthCheckResponse.SERVING
LONG = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}
# "At once": a refusal is not queued behind the work in flight.
AT_ONCE = 2.0


def test_server_metrics_and_worker_listen_on_loopback_unless_told_otherwise():
    from tokenbudget.server.entrypoints.cli import build_parser
    from tokenbudget.worker.__main__ import build_parser as worker_parser

    # The metrics port binds --host too (server/entrypoints/cli.py main).
    assert build_parser().parse_args([]).host == "127.0.0.1"
    assert build_parser().parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"
    assert worker_parser().parse_args([]).host == "127.0.0.1"


# -- authentication ------------------------------------------------------------------------
@pytest.mark.parametrize("api_key", [None, "wrong-key"], ids=["no key", "wrong key"])
def test_a_missing_or_wrong_api_key_is_unauthenticated_but_health_stays_open(faults, api_key):
    with faults.public_client(api_key=api_key) as c:
        for call in (
            lambda: c.generate("hi", max_tokens=2),
            c.model_info,
            c.stats,
            lambda: c.abort("someone-elses-id"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <key>" in err.value.details()
            assert API_KEY not in err.value.details()
        assert health(c.channel) == SERVING  # orchestrators probe without the key
    with faults.public_client() as c:
        assert c.generate("hi", max_tokens=2, ignore_eos=True).completion_tokens == 2


# -- what an unkeyed or abusive client costs (issue 26) ----------------------------------
def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no VmHWM in /proc/<pid>/status")


def test_unkeyed_calls_are_refused_on_metadata_without_reading_the_message(faults):
    """Four unkeyed 60 MB Generate calls: each is UNAUTHENTICATED, the server's
    peak RSS grows by less than 64 MB (parsed, they cost ~460 MB), and a keyed
    client's small request meanwhile completes within a second."""
    pid = faults.public.proc.pid
    before = _peak_rss_mb(pid)
    big = generate_pb2.GenerateRequest(text="x" * (60 << 20))
    codes: list = []

    def unkeyed() -> None:
        channel = faults.public_channel()
        try:
            stub = generate_pb2_grpc.GenerationStub(channel)
            list(stub.Generate(big, timeout=60))
        except grpc.RpcError as exc:
            codes.append(exc.code())
        finally:
            channel.close()

    threads = [threading.Thread(target=unkeyed) for _ in range(4)]
    for t in threads:
        t.start()
    with faults.public_client() as c:
        start = time.monotonic()
        got = c.generate(PROBE, max_tokens=4, temperature=0, ignore_eos=True)
        took = time.monotonic() - start
        assert got.token_ids == faults.reference[:4]
    for t in threads:
        t.join(120)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    assert took < 2.0, took  # the issue asks 1 s; room for a busy 2-core machine
    assert _peak_rss_mb(pid) - before < 64, (before, _peak_rss_mb(pid))
    with faults.public_channel() as ch:
        assert health(ch) == SERVING


def test_the_request_id_is_sent_once_per_stream(faults):
    """A 256-byte id (the most --max-id-bytes allows by default) comes back on
    the stream's first message only; the Client still hands it on every one."""
    rid = "r" * 256
    with faults.public_channel() as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        request = generate_pb2.GenerateRequest(request_id=rid, text=PROBE)
        request.sampling_params.max_tokens = 8
        request.sampling_params.ignore_eos = True
        request.sampling_params.temperature = 0
        metadata = bearer_metadata(API_KEY)
        replies = list(stub.Generate(request, timeout=30, metadata=metadata))
    assert len(replies) >= 2
    assert [r.request_id for r in replies] == [rid] + [""] * (len(replies) - 1)
    assert sum(r.ByteSize() for r in replies[1:]) < 100 * len(replies)
    with faults.public_client() as c:
        msgs = list(c.generate_stream(PROBE, request_id=rid, max_tokens=4, ignore_eos=True))
        assert {m.request_id for m in msgs} == {rid}
        assert_idle(wait_idle(c.stats))


def test_mutual_tls_refuses_a_client_without_a_certificate_and_plaintext(faults):
    if faults.tls is None:
        pytest.skip("openssl is not on PATH: no certificates to serve TLS with")
    for client in (
        Client(
            faults.public.address, api_key=API_KEY, root_certificates=faults.tls.ca
        ),  # TLS, but no client certificate
        Client(faults.public.address, api_key=API_KEY),
    ):  # plaintext
        with client, pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with faults.public_client() as c:  # the CA's client certificate
        assert c.model_info().num_blocks == 512


# -- limits --------------------------------------------------------------------------------
def _open_streams(c: Client, count: int, **sampling) -> list:
    """``count`` generation calls, sent (the server may not have them yet)."""
    return [
        c.stub.Generate(_request(f"flood {i}", **sampling), metadata=c.metadata)
        for i in range(count)
    ]


def _request(prompt: str, **sampling) -> generate_pb2.GenerateRequest:
    from tokenbudget.core import SamplingParams
    from tokenbudget.server.entrypoints.client import make_request

    return make_request(prompt, SamplingParams(**sampling))


def _refusals(c: Client, n: int) -> list[tuple[grpc.StatusCode, str, float]]:
    """Send ``n`` generations at once; each one's status, details and seconds taken."""

    def one(i: int):
        start = time.monotonic()
        try:
            for _ in c.stub.Generate(
                _request(f"extra {i}", **LONG), metadata=c.metadata, timeout=30
            ):
                pass
            return grpc.StatusCode.OK, "", time.monotonic() - start
        except grpc.RpcError as e:
            return e.code(), e.details(), time.monotonic() - start

    with futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_flood_beyond_max_concurrent_rpcs_is_refused_at_once_and_probes_answer(faults):
    with faults.public_client() as c:
        calls = _open_streams(c, MAX_RPCS, **LONG)
        try:
            _wait_for(lambda: c.stats().num_requests == MAX_RPCS)
            s = c.stats()  # answered at the limit
            assert (s.num_running, s.num_waiting) == (MAX_SEQS, MAX_RPCS - MAX_SEQS), s
            refused = _refusals(c, 32)
            assert {code for code, _, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert all(f"--max-concurrent-rpcs={MAX_RPCS}" in d for _, d, _ in refused)
            assert max(t for _, _, t in refused) < AT_ONCE, refused
            # Probes are not generations: answered while the limit is reached.
            assert health(c.channel) == SERVING
            assert c.model_info().max_model_len > 0
            assert c.stats().num_requests == MAX_RPCS
        finally:
            # Many streams cancelled at once: every one of them frees its KV.
            cancelled_at = time.monotonic()
            for call in calls:
                call.cancel()
        assert_idle(wait_idle(c.stats))
        assert time.monotonic() - cancelled_at < 10.0
        assert all(call.code() == grpc.StatusCode.CANCELLED for call in calls)


def test_flood_beyond_max_queued_requests_is_refused_at_once(faults):
    with faults.public_client() as c:
        running = _open_streams(c, 1, n=MAX_SEQS, **LONG)
        queued = []
        try:
            _wait_for(lambda: c.stats().num_running == MAX_SEQS)
            # One call whose MAX_QUEUED samples fill the waiting queue.
            queued = _open_streams(c, 1, n=MAX_QUEUED, **LONG)
            _wait_for(lambda: c.stats().num_waiting == MAX_QUEUED)
            refused = _refusals(c, 4)
            assert {code for code, _, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert all(f"max_queued_requests={MAX_QUEUED}" in d for _, d, _ in refused), refused
            assert max(t for _, _, t in refused) < AT_ONCE, refused
            assert health(c.channel) == SERVING
        finally:
            for call in running + queued:
                call.cancel()
        assert_idle(wait_idle(c.stats))


def _wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


# -- tenants -------------------------------------------------------------------------------
def test_cache_salt_keeps_tenants_prefix_caches_apart(faults):
    prompt = "A shared system prompt that is long enough to fill some blocks. " * 3
    params = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with faults.public_client() as c:
        first = c.generate(prompt, cache_salt="tenant-a", **params)
        same = c.generate(prompt, cache_salt="tenant-a", **params)
        other = c.generate(prompt, cache_salt="tenant-b", **params)
        unsalted = c.generate(prompt, **params)
    assert first.prompt_tokens > 32
    assert first.cached_tokens == 0
    # Every full block of the prompt but the last token's is a hit for the same salt.
    assert same.cached_tokens == (first.prompt_tokens - 1) // 16 * 16
    assert other.cached_tokens == 0 and unsalted.cached_tokens == 0


# -- the last test: it stops the server ------------------------------------------------------
def test_sigterm_mid_stream_finishes_every_stream_then_exits_0(faults):
    n, max_tokens = 8, 120  # long enough to be mid-stream at the signal
    results: list = []
    with faults.public_client() as c:
        calls = [
            c.stub.Generate(
                _request(f"drain {i}", max_tokens=max_tokens, temperature=0, ignore_eos=True),
                metadata=c.metadata,
            )
            for i in range(n)
        ]
        firsts = [next(call) for call in calls]  # every stream is mid-way

        def finish(call, first) -> None:
            try:
                msgs = [first, *call]
                results.append((sum(len(m.token_ids) for m in msgs), msgs[-1].finish_reason))
            except grpc.RpcError as e:
                results.append((e.code(), e.details()))

        threads = [threading.Thread(target=finish, args=a) for a in zip(calls, firsts)]
        for t in threads:
            t.start()
        faults.public.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert results == [(max_tokens, "length")] * n  # no stream lost
    assert faults.public.proc.wait(60) == 0
    log = "".join(faults.public.log)
    assert "Traceback" not in log and "leaked" not in log, log
    # Nothing left behind once the streams ended (512 blocks less the null block).
    assert "drained: 0 requests running, 0 waiting, 0 of 511 KV blocks in use" in log, log
