"""How fast `server --worker` notices a lost or hung worker and serves again.
Prints one JSON line per fault.

    python benchmarks/worker_recovery.py                   # tiny random Qwen3
    python benchmarks/worker_recovery.py --streams 16 --step-timeout 2

`kill`: N greedy streams run; the worker is SIGKILLed. Measured: the time
until the last stream fails (UNAVAILABLE), and, after a new worker on the
same port prints that it listens, the time until health is SERVING again
(the server's backoff, Initialize and the model load).
`stop`: the same with SIGSTOP (a hung worker; --worker-step-timeout
detects it), then SIGCONT: detection time and time back to SERVING.
Both report GetStats right after the fault (running, waiting, KV blocks in
use: all 0 when nothing leaked).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenbudget.server.entrypoints.client import Client

BIN = Path(sys.executable).parent
SERVING = health_pb2.HealthCheckResponse.SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if " listening on " in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it drained
            return proc, int(line.rsplit(":", 1)[1])
    raise RuntimeError(f"{argv[0]} exited before listening")


def _worker(port: int) -> subprocess.Popen:
    return _start(
        [
            sys.executable,
            "-m",
            "tokenbudget.worker",
            "--port",
            str(port),
            "--threads",
            "1",
            "--log-level",
            "warning",
        ]
    )[0]


def _seconds_until_serving(address: str, timeout: float = 120.0) -> float:
    start = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() - start < timeout:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING:
                    return time.monotonic() - start
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise RuntimeError(f"{address} not SERVING after {timeout} s")


def _fault(address: str, streams: int, strike) -> dict:
    """Run ``streams`` long streams, call ``strike()``; seconds until the last
    fails and GetStats just after."""
    failed: list[float] = []
    started = threading.Barrier(streams + 1)

    def run(i: int) -> None:
        with Client(address) as c:
            it = c.generate_stream(f"stream {i}", max_tokens=3000, temperature=0, ignore_eos=True)
            try:
                next(it)
                started.wait(60)
                for _ in it:
                    pass
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    failed.append(time.monotonic())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait(120)
    at = time.monotonic()
    strike()
    for t in threads:
        t.join(120)
    with Client(address) as c:
        s = c.stats()
    return {
        "streams_failed": len(failed),
        "last_failure_s": round(max(failed) - at, 3) if failed else None,
        "after": {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "blocks_in_use": s.num_total_blocks - s.num_free_blocks,
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny random Qwen3)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--step-timeout", type=float, default=3.0)
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=512,
        help="KV blocks (default %(default)s; the CPU default of 1 GiB of KV adds "
        "seconds to every Initialize)",
    )
    args = p.parse_args()
    model = args.model
    if model is None:
        from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

        model = build_tiny_qwen3(tempfile.mkdtemp(prefix="tiny_qwen3_"), seed=0)
    port = _free_port()
    worker = _worker(port)
    server, server_port = _start(
        [
            str(BIN / "server"),
            "--model",
            model,
            "--port",
            "0",
            "--torch-threads",
            "1",
            "--worker",
            f"127.0.0.1:{port}",
            "--worker-step-timeout",
            str(args.step_timeout),
            "--num-gpu-blocks",
            str(args.num_gpu_blocks),
            "--log-level",
            "warning",
        ]
    )
    address = f"127.0.0.1:{server_port}"
    try:
        _seconds_until_serving(address)
        kill = _fault(address, args.streams, worker.kill)
        worker.wait()
        worker = _worker(port)
        kill["serving_again_s"] = round(_seconds_until_serving(address), 3)
        print(
            json.dumps(
                {
                    "fault": "kill",
                    "streams": args.streams,
                    "num_gpu_blocks": args.num_gpu_blocks,
                    **kill,
                }
            ),
            flush=True,
        )

        stop = _fault(address, args.streams, lambda: worker.send_signal(signal.SIGSTOP))
        worker.send_signal(signal.SIGCONT)
        stop["serving_again_s"] = round(_seconds_until_serving(address), 3)
        print(
            json.dumps(
                {
                    "fault": "stop",
                    "streams": args.streams,
                    "step_timeout_s": args.step_timeout,
                    **stop,
                }
            ),
            flush=True,
        )
    finally:
        for proc in (server, worker):
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
