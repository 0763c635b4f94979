"""Start-up and shutdown of `server` processes: signals at the edges of
start-up, and the ports it reports (issue 24, item 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from tests.grpc.conftest import free_port

BIN = Path(sys.executable).parent
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


def _server(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "server"), "--port", "0", "--torch-threads", "1", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def _read_until(proc: subprocess.Popen, stream, needle: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    for line in stream:
        seen.append(line)
        if needle in line:
            return line
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError(f"{needle!r} never came:\n" + "".join(seen))


def test_sigterm_the_instant_listening_is_printed_drains_and_exits_0(tiny_model):
    """The signal handlers are in place before the port opens: a SIGTERM that
    comes as the `listening` line does is a drain, not a kill (before the fix,
    2 of 3 such stops died by the signal, exit -15). Ten servers, each
    signalled from the thread that reads its line."""
    procs = [_server("--model", tiny_model, "--num-gpu-blocks", "32") for _ in range(10)]

    def stop_when_listening(proc: subprocess.Popen) -> tuple[int, str]:
        _read_until(proc, proc.stdout, " listening on ", timeout=240)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err

    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            results = list(pool.map(stop_when_listening, procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for returncode, err in results:
        assert returncode == 0, err
        assert "drained: 0 requests running, 0 waiting" in err


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tiny_model):
    """Ctrl-C while start-up waits (here on a --worker nobody answers): one
    line, status 130 (as a shell reports SIGINT), no traceback."""
    port = free_port()
    proc = _server(
        "--model", tiny_model, "--worker", f"127.0.0.1:{port}", "--worker-connect-timeout", "120"
    )
    _read_until(proc, proc.stderr, "driving remote workers")
    time.sleep(0.5)  # inside the connect wait
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "server: interrupted during start-up"


def test_metrics_port_0_logs_the_port_it_got(tiny_model):
    proc = _server("--model", tiny_model, "--num-gpu-blocks", "32", "--metrics-port", "0")
    try:
        line = _read_until(proc, proc.stderr, "Prometheus metrics on http://")
        url = line.split("Prometheus metrics on ", 1)[1].strip()
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        assert port != 0
        with urllib.request.urlopen(url, timeout=30) as reply:
            assert b"tokenbudget:num_requests_running" in reply.read()
    finally:
        proc.kill()
        proc.communicate(timeout=60)
