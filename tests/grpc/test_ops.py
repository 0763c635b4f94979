"""Operating the processes: versions, log lines, one owner per port, clean exits.

One real `server` (in-process model) and one worker process are started for
the module and stopped by the last test, which checks how they exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from tokenbudget.server.entrypoints.cli import build_parser
from tokenbudget.server.entrypoints.client import Client

BIN = Path(sys.executable).parent
START_TIMEOUT = 240.0
EXIT_TIMEOUT = 60.0
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
# The line gRPC's C core, nanobind or Python print when an exit is not clean.
UNCLEAN = ("leaked", "Traceback")


@dataclass
class Process:
    proc: subprocess.Popen
    log_path: Path
    port: int = 0

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_for(self, text: str, timeout: float) -> str:
        """Wait until the log holds ``text``; the log. Fails if the process exits first."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log):
            if self.proc.poll() is not None and text not in self.log:
                raise AssertionError(f"exited {self.proc.returncode} before {text!r}:\n{log}")
            assert time.monotonic() < deadline, f"no {text!r} in {timeout}s:\n{log}"
            time.sleep(0.05)
        return log

    def wait_exit(self, timeout: float = EXIT_TIMEOUT) -> int:
        """The exit status; fails at once if the process starts listening instead."""
        deadline = time.monotonic() + timeout
        while (rc := self.proc.poll()) is None:
            if " listening on " in self.log:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"it started serving instead of exiting:\n{self.log}")
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"still running after {timeout}s:\n{self.log}")
            time.sleep(0.05)
        return rc


def start(argv: list[str], log_path: Path) -> Process:
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    return Process(proc, log_path)


def wait_listening(p: Process) -> Process:
    line = p.wait_for(" listening on ", START_TIMEOUT).split(" listening on ", 1)[1]
    p.port = int(line.split("\n", 1)[0].rsplit(":", 1)[1])
    return p


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Ops:
    server: Process  # in-process model, --log-level debug, --metrics-port
    worker: Process  # --log-level warning, initialized with the tiny model
    metrics_port: int
    model: str
    trace_path: Path  # --record-trace: written when the server exits


@pytest.fixture(scope="module")
def ops(tiny_model, tmp_path_factory) -> Ops:
    from tokenbudget.core import CacheConfig, SchedulerConfig
    from tokenbudget.proto import convert, worker_pb2, worker_pb2_grpc

    logs = tmp_path_factory.mktemp("ops")
    metrics_port = free_port()
    procs = [
        start(
            [
                str(BIN / "server"),
                "--model",
                tiny_model,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--torch-threads",
                "1",
                "--num-gpu-blocks",
                "64",
                "--metrics-port",
                str(metrics_port),
                "--log-level",
                "debug",
                "--log-stats-interval",
                "0.2",
                "--record-trace",
                str(logs / "trace.jsonl"),
            ],
            logs / "server.log",
        ),
        start(
            [
                sys.executable,
                "-m",
                "tokenbudget.worker",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--threads",
                "1",
                "--log-level",
                "warning",
            ],
            logs / "worker.log",
        ),
    ]
    try:
        server, worker = (wait_listening(p) for p in procs)
        # Load the model in the worker as a server would (and freeze its heap).
        request = worker_pb2.InitializeRequest(model=tiny_model, dtype="float32", device="cpu")
        convert.configs_to_proto(
            CacheConfig(block_size=16, num_blocks=32),
            SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
            request,
        )
        with grpc.insecure_channel(worker.address) as ch:
            worker_pb2_grpc.WorkerStub(ch).Initialize(request, timeout=START_TIMEOUT)
        yield Ops(server, worker, metrics_port, tiny_model, logs / "trace.jsonl")
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(10)


# -- versions and flags ------------------------------------------------------------------
def test_server_python_m_server_and_worker_print_the_package_version(tmp_path):
    commands = {
        "server": [str(BIN / "server"), "--version"],
        "python -m tokenbudget.server": [sys.executable, "-m", "tokenbudget.server", "--version"],
        "python -m tokenbudget.worker": [sys.executable, "-m", "tokenbudget.worker", "--version"],
    }
    procs = {
        name: subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
        )
        for name, argv in commands.items()
    }
    version = metadata.version("tokenbudget")
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=EXIT_TIMEOUT)
        assert proc.returncode == 0, out
        assert out.strip().endswith(f"(tokenbudget) {version}"), out


def test_dtype_is_checked_by_the_parser_and_every_flag_explains_itself(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp32"])
    assert "invalid choice: 'fp32'" in capsys.readouterr().err
    assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    undocumented = [a.option_strings[0] for a in parser._actions if not a.help]
    assert undocumented == []
    kv_help = next(a.help for a in parser._actions if "--kv-cache-memory" in a.option_strings)
    assert "1GiB" in kv_help


# -- log lines ---------------------------------------------------------------------------
def test_debug_level_logs_a_line_per_finished_request_and_a_periodic_stats_line(ops):
    with Client(ops.server.address) as c:
        for i in range(3):
            c.generate(
                "Hello there", max_tokens=8, temperature=0, ignore_eos=True, request_id=f"dbg-{i}"
            )

    def stats_lines() -> list[str]:
        return [x for x in ops.server.log.splitlines() if "Avg generation throughput" in x]

    deadline = time.monotonic() + 30
    while sum(_count(x, "Finished") for x in stats_lines()) < 3:
        assert time.monotonic() < deadline, ops.server.log
        time.sleep(0.05)
    lines = stats_lines()
    assert sum(_count(x, "Finished") for x in lines) == 3
    assert all(" INFO " in x for x in lines)
    assert sum(float(x.split("throughput: ")[1].split()[0]) for x in lines) > 0
    # The line that counted the last request shows the engine drained.
    assert "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in lines[-1], lines
    finished = [x for x in ops.server.log.splitlines() if "request" in x and "finished" in x]
    assert len(finished) == 3, ops.server.log
    assert all(" DEBUG " in x and "output 8 tokens" in x and "TTFT" in x for x in finished)
    assert [x.split("request ")[1].split()[:2] for x in finished] == [
        [f"dbg-{i}", "finished"] for i in range(3)
    ]
    assert all("(length)" in x for x in finished)


def _count(line: str, label: str) -> int:
    """N in "label: N reqs"."""
    return int(line.split(f"{label}: ")[1].split()[0])


def test_warning_level_worker_logs_no_info_lines(ops):
    log = ops.worker.log
    assert "tokenbudget worker listening on" in log  # the readiness line is not a log line
    # Initialize logs "loading ...", "KV cache: ..." and "gc: froze ..." at info.
    assert " INFO " not in log and "KV cache:" not in log, log


# -- gRPC reflection -----------------------------------------------------------------------
@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_services_and_serves_descriptors_under_v1_and_v1alpha(ops, version):
    with grpc.insecure_channel(ops.server.address) as ch:
        info = ch.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        listed, described = info(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="tokenbudget.v1.Generation"
                    ),
                ]
            ),
            timeout=30,
        )
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "tokenbudget.v1.Generation",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert described.file_descriptor_response.file_descriptor_proto


# -- one owner per port ------------------------------------------------------------------
@pytest.mark.parametrize("taken", ["server port", "metrics port", "worker port"])
def test_a_second_process_on_a_taken_port_exits_nonzero_naming_the_address(ops, taken, tmp_path):
    server = [
        str(BIN / "server"),
        "--model",
        ops.model,
        "--host",
        "127.0.0.1",
        "--torch-threads",
        "1",
        "--num-gpu-blocks",
        "64",
    ]
    argv, message = {
        "server port": (
            server + ["--port", str(ops.server.port)],
            f"server: cannot listen on {ops.server.address}: address already in use",
        ),
        "metrics port": (
            server + ["--port", "0", "--metrics-port", str(ops.metrics_port)],
            f"server: cannot serve metrics on 127.0.0.1:{ops.metrics_port}: address already in use",
        ),
        "worker port": (
            [
                sys.executable,
                "-m",
                "tokenbudget.worker",
                "--host",
                "127.0.0.1",
                "--port",
                str(ops.worker.port),
            ],
            f"worker: cannot listen on {ops.worker.address}: address already in use",
        ),
    }[taken]
    second = start(argv, tmp_path / "second.log")
    assert second.wait_exit() != 0
    assert message in second.log
    assert not any(x in second.log for x in UNCLEAN), second.log


# -- clean exits (last: stops the module's processes) -----------------------------------
def test_server_and_worker_exit_0_on_sigterm_without_leaked_lines(ops):
    for p in (ops.server, ops.worker):
        p.proc.send_signal(signal.SIGTERM)
    for p in (ops.server, ops.worker):
        rc = p.proc.wait(EXIT_TIMEOUT)
        assert rc == 0, p.log
        assert not any(x in p.log for x in UNCLEAN), p.log


def test_the_server_wrote_its_trace_at_exit_lengths_and_hashes_without_text(ops):
    """--record-trace: after the SIGTERM above, every finished request of this
    module is in the file (the debug test's three "Hello there" ones included),
    with lengths but no text and no token ids; the simulator can load it."""
    from transformers import AutoTokenizer

    from tokenbudget.server.engine.trace import load_trace

    assert ops.server.proc.poll() is not None, "runs after the SIGTERM test"
    trace, block_size = load_trace(ops.trace_path)
    hello = len(AutoTokenizer.from_pretrained(ops.model).encode("Hello there"))
    assert block_size == 16
    assert sum(1 for r in trace if (r.prompt_len, r.output_len) == (hello, 8)) >= 3
    assert all(r.prompt_len > 0 and r.output_len > 0 for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert "Hello" not in ops.trace_path.read_text()


def test_configure_gc_leaves_no_leaked_lines_at_interpreter_exit():
    pytest.importorskip("triton")
    # Frozen at start-up, triton's objects would outlive their module.
    code = (
        "import triton\nfrom tokenbudget.core.utils.gc_policy import configure_gc\nconfigure_gc()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=EXIT_TIMEOUT, env=ENV
    )
    assert out.returncode == 0, out.stderr
    assert "leaked" not in out.stderr, out.stderr
