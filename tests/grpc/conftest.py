"""Real `server` / worker processes on ephemeral ports, started once per session.

Process start-up (importing torch + transformers) dominates on a busy box, so
every process the folder needs is launched at once, in parallel, and shared.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenbudget.server.entrypoints.client import Client

BIN = Path(sys.executable).parent
START_TIMEOUT = 240.0


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    port: int = 0
    log: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_listening(self, timeout: float = START_TIMEOUT) -> Proc:
        if not self._ready.wait(timeout) or not self.port:
            self.proc.kill()
            raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.log[-40:]))
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def spawn(name: str, argv: list[str]) -> Proc:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    p = Proc(name, proc)

    def pump() -> None:  # keep the pipe drained; note the bound port
        for line in proc.stdout:
            p.log.append(line)
            if " listening on " in line:
                p.port = int(line.rsplit(":", 1)[1])
                p._ready.set()
        p._ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return p


def spawn_server(name: str, model: str, *extra: str) -> Proc:
    # No --host: the servers and workers run with the default bind address,
    # which test_server.py checks is loopback only.
    return spawn(
        name,
        [
            str(BIN / "server"),
            "--model",
            model,
            "--port",
            "0",
            "--torch-threads",
            "1",
            "--grpc-threads",
            "256",
            *extra,
        ],
    )


def spawn_worker(name: str, port: int) -> Proc:
    return spawn(
        name, [sys.executable, "-m", "tokenbudget.worker", "--port", str(port), "--threads", "1"]
    )


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on ``port`` (Linux /proc:
    each address is 32-bit words in host order, written in hex)."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp to read listening sockets from")
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(hex_addr)
            ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            found.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout: float = START_TIMEOUT) -> None:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} never answered SERVING")
            time.sleep(0.2)


# Scheduling knobs shared by the servers and the in-process oracle, chosen so a
# handful of requests chunk their prompts.
MAX_NUM_BATCHED_TOKENS = 64
MAX_MESSAGE_SIZE = 1 << 20


@dataclass
class Cluster:
    model: str
    local: Proc  # server with an in-process worker
    remote: Proc  # server driving `worker`
    worker: Proc
    spare: Proc  # a server the drain test may stop
    metrics_port: int  # of `local`


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def cluster(tiny_model) -> Cluster:
    knobs = ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--num-gpu-blocks", "512"]
    # Everything starts at once; the remote server waits for its worker.
    metrics_port, worker_port = free_port(), free_port()
    procs = [
        spawn_worker("worker", worker_port),
        spawn_server(
            "server",
            tiny_model,
            "--max-message-size",
            str(MAX_MESSAGE_SIZE),
            "--metrics-port",
            str(metrics_port),
            *knobs,
        ),
        spawn_server("remote-server", tiny_model, "--worker", f"127.0.0.1:{worker_port}", *knobs),
        # Busy polling on: test_server.py checks its spinning threads, and the
        # drain test that it still drains and exits 0.
        spawn_server("spare-server", tiny_model, "--busy-poll", *knobs),
    ]
    try:
        for p in procs:
            p.wait_listening()
        for p in procs[1:]:
            wait_serving(p.address)
    except Exception:
        for p in procs:
            p.stop()
        raise
    worker, local, remote, spare = procs
    yield Cluster(tiny_model, local, remote, worker, spare, metrics_port)
    for p in reversed(procs):
        p.stop()


@pytest.fixture(scope="session")
def client(cluster) -> Client:
    c = Client(cluster.local.address)
    yield c
    c.close()


@pytest.fixture(scope="session")
def oracle(tiny_model):
    """The in-process LLM with the servers' scheduling settings (sync loop)."""
    import torch

    from tokenbudget.server.entrypoints.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(
        tiny_model,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        num_gpu_blocks=512,
        async_scheduling=False,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def tiny_vl_model(tmp_path_factory) -> str:
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), seed=0)


@pytest.fixture(scope="session")
def vl_server(tiny_vl_model) -> Proc:
    from tokenbudget.worker.model_runner import ModelRunner

    if ModelRunner(tiny_vl_model, device="cpu").vision is None:
        pytest.skip(
            "the ModelRunner does not run vision-language models yet (ModelRunner.vision is None)"
        )
    p = spawn_server(
        "vl-server", tiny_vl_model, "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)
    )
    try:
        p.wait_listening()
        wait_serving(p.address)
    except Exception:
        p.stop()
        raise
    yield p
    p.stop()


@pytest.fixture(scope="module")
def faulty_remote(tiny_model) -> Proc:
    """A server driving a real worker process that fails any step sampling a
    request seeded 2989 (tests/grpc/faulty_worker.py)."""
    port = free_port()
    worker = spawn(
        "faulty-worker",
        [
            sys.executable,
            str(Path(__file__).with_name("faulty_worker.py")),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "1",
        ],
    )
    server = spawn_server(
        "faulty-remote-server",
        tiny_model,
        "--worker",
        f"127.0.0.1:{port}",
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--num-gpu-blocks",
        "128",
    )
    try:
        for p in (worker, server):
            p.wait_listening()
        wait_serving(server.address)
    except Exception:
        server.stop()
        worker.stop()
        raise
    yield server
    server.stop()
    worker.stop()
