"""Process faults against real processes: a `server` driving a remote
`python -m tokenbudget.worker` (killed, stopped, restarted), and a `server`
with TLS, mutual TLS, an API key and small generation/queue limits (flooded,
cancelled, drained). Everything starts at once, in parallel, for the session.

The process helpers are tests/grpc/conftest.py's (loaded by path under the
module name pytest gives it, so pytest reuses that one module).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenbudget.server.entrypoints.client import Client


def _grpc_conftest():
    name = "tests.grpc.conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parents[1] / "grpc" / "conftest.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_helpers = _grpc_conftest()
Proc, spawn, spawn_server, free_port, wait_serving, listening_addresses = (
    _helpers.Proc,
    _helpers.spawn,
    _helpers.spawn_server,
    _helpers.free_port,
    _helpers.wait_serving,
    _helpers.listening_addresses,
)
BIN, START_TIMEOUT = _helpers.BIN, _helpers.START_TIMEOUT

# The remote server's hung-worker bound once its worker has answered steps
# (--worker-hang-timeout; the first-step allowance, --worker-step-timeout,
# stays at its 300 s default): far above a tiny model's step (ms), short
# enough for a test.
STEP_TIMEOUT = 3.0
# Shared by both servers: a single request runs the same steps on either, so
# greedy tokens compare.
KNOBS = ["--max-num-batched-tokens", "64", "--num-gpu-blocks", "512"]
# The public server's limits: 16 generations in flight, 4 running, 16 waiting.
MAX_RPCS, MAX_SEQS, MAX_QUEUED = 16, 4, 16
API_KEY = "test-key-9f2c"
PROBE = "Recovery probe: the quick brown fox"
PROBE_TOKENS = 12


@dataclass
class Tls:
    ca: bytes
    client_cert: bytes
    client_key: bytes
    server_args: list[str]


@dataclass
class Faults:
    model: str
    secret_file: Path
    worker: Proc  # --worker-secret-file; killed and restarted by the tests
    worker_port: int
    remote: Proc  # server --worker ... --worker-hang-timeout STEP_TIMEOUT
    public: Proc  # in-process model; TLS + mTLS (when openssl exists), --api-key, limits
    tls: Tls | None
    reference: list[int]  # PROBE's greedy tokens on the fresh public server

    def public_client(self, **kwargs) -> Client:
        """A client of the public server with its key and (when TLS) client cert."""
        kwargs.setdefault("api_key", API_KEY)
        if self.tls is not None:
            kwargs.setdefault("root_certificates", self.tls.ca)
            kwargs.setdefault("certificate_chain", self.tls.client_cert)
            kwargs.setdefault("private_key", self.tls.client_key)
        return Client(self.public.address, **kwargs)

    def public_channel(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.public.address)
        return grpc.secure_channel(
            self.public.address,
            grpc.ssl_channel_credentials(self.tls.ca, self.tls.client_key, self.tls.client_cert),
        )


def spawn_worker(name: str, port: int, *extra: str) -> Proc:
    return spawn(
        name,
        [sys.executable, "-m", "tokenbudget.worker", "--port", str(port), "--threads", "1", *extra],
    )


def make_tls(folder: Path) -> Tls | None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made
    with openssl (None without it)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=tokenbudget test CA",
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (folder / f"{name}.ext").write_text(ext + "\n")
        run(
            "req",
            *key,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=tokenbudget test {name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return Tls(
        (folder / "ca.pem").read_bytes(),
        (folder / "client.pem").read_bytes(),
        (folder / "client.key").read_bytes(),
        [
            "--tls-cert",
            str(folder / "server.pem"),
            "--tls-key",
            str(folder / "server.key"),
            "--tls-client-ca",
            str(folder / "ca.pem"),
        ],
    )


def health(channel: grpc.Channel, timeout: float = 5.0) -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        .status
    )


def wait_health(channel: grpc.Channel, status: int, timeout: float) -> float:
    """Seconds until health reports ``status``; fails after ``timeout``."""
    start = time.monotonic()
    while True:
        try:
            if health(channel) == status:
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        if time.monotonic() - start > timeout:
            raise AssertionError(f"health never reported {status} in {timeout} s")
        time.sleep(0.1)


def assert_idle(stats) -> None:
    """No request left and every KV block free: nothing lost, nothing leaked."""
    assert (stats.num_requests, stats.num_running, stats.num_waiting) == (0, 0, 0), stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert stats.kv_cache_usage == 0.0, stats


def wait_idle(stats_of, timeout: float = 10.0):
    """The first stats with no request live, polling ``stats_of()``."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats_of()
        if (
            s.num_requests == 0
            and s.num_running == 0
            and s.num_waiting == 0
            and s.num_free_blocks == s.num_total_blocks
        ):
            return s
        if time.monotonic() > deadline:
            return s  # the caller's assert_idle says what is left
        time.sleep(0.05)


@pytest.fixture(scope="session")
def faults(tiny_qwen3_path, tmp_path_factory) -> Faults:
    folder = tmp_path_factory.mktemp("faults")
    secret_file = folder / "worker.secret"
    secret_file.write_text(os.urandom(16).hex() + "\n")
    secret_file.chmod(0o600)
    tls = make_tls(folder)
    worker_port = free_port()
    procs = [
        spawn_worker("worker", worker_port, "--worker-secret-file", str(secret_file)),
        spawn_server(
            "remote-server",
            tiny_qwen3_path,
            "--worker",
            f"127.0.0.1:{worker_port}",
            "--worker-secret-file",
            str(secret_file),
            "--worker-hang-timeout",
            str(STEP_TIMEOUT),
            *KNOBS,
        ),
        spawn_server(
            "public-server",
            tiny_qwen3_path,
            "--api-key",
            API_KEY,
            "--max-concurrent-rpcs",
            str(MAX_RPCS),
            "--max-num-seqs",
            str(MAX_SEQS),
            "--max-queued-requests",
            str(MAX_QUEUED),
            *(tls.server_args if tls else ()),
            *KNOBS,
        ),
    ]
    try:
        for p in procs:
            p.wait_listening()
        wait_serving(procs[1].address)
        partial = Faults(
            tiny_qwen3_path, secret_file, procs[0], worker_port, procs[1], procs[2], tls, []
        )
        with partial.public_channel() as ch:
            wait_health(ch, health_pb2.HealthCheckResponse.SERVING, START_TIMEOUT)
        with partial.public_client() as c:
            partial.reference = c.generate(
                PROBE, max_tokens=PROBE_TOKENS, temperature=0, ignore_eos=True
            ).token_ids
        with Client(partial.remote.address) as c:  # the worker has answered steps
            c.generate(PROBE, max_tokens=4, temperature=0, ignore_eos=True)
    except Exception:
        for p in procs:
            p.stop()
        raise
    yield partial
    for p in (partial.worker, *procs[1:]):
        p.stop()
