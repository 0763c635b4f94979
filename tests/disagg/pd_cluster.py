"""Real prefill/decode `server` processes behind the real SGLang gateway in
P/D mode, for the end-to-end tests of this folder (the gateway tests'
process helpers, tests/gateway/conftest.py, do the starting)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from tests.gateway.conftest import BIN, ENV, START_TIMEOUT, Gateway, Process, free_port, start
from tokenbudget.server.entrypoints.client import Client
from tokenbudget.server.testing.tiny_models import QWEN_SPECIAL_TOKENS

BLOCK = 16
NEW_TOKENS = 12
# Every server's --disaggregation-timeout: how long a decode waits for a
# prompt's KV, and a prefill holds a finished prompt's KV for its decode.
TIMEOUT = 5.0


def server(name: str, model: str, log_dir: Path, *extra: str, timeout: float = TIMEOUT) -> Process:
    argv = [str(BIN / "server"), "--model", model, "--host", "127.0.0.1", "--port", "0"]
    argv += ["--torch-threads", "1", "--num-gpu-blocks", "256", *extra]
    argv += ["--disaggregation-timeout", str(timeout)]
    return start(name, argv, log_dir)


def pd_gateway(
    name: str,
    prefill: Process,
    decode: Process,
    port: int,
    model: str,
    log_dir,
    tiktoken,
    *extra: str,
) -> Gateway:
    """The gateway over one pair, ``port`` given as the prefill's bootstrap
    port (``extra``: more gateway flags); returned once it reports both healthy."""
    gw_port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    argv += ["--port", str(gw_port), "--pd-disaggregation"]
    argv += ["--prefill", f"grpc://{prefill.address}", str(port)]
    argv += ["--decode", f"grpc://{decode.address}", "--policy", "random", "--model-path", model]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    argv += ["--health-check-interval-secs", "1", "--worker-startup-check-interval", "1", *extra]
    p = start(name, argv, log_dir, dict(ENV, TIKTOKEN_ENCODINGS_BASE=str(tiktoken)))
    gw = Gateway(p, gw_port, model)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            status, body = gw.get("/workers")
            workers = body["workers"] if status == 200 else []
            if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                return gw
        except OSError:
            pass
        if p.proc.poll() is not None or time.monotonic() > deadline:
            p.stop()
            raise RuntimeError(f"{name} did not start:\n{p.log[-4000:]}")
        time.sleep(0.1)


def wait_healthy(gateway: Gateway, within: float) -> None:
    """Until the gateway reports every worker it knows healthy."""
    deadline = time.monotonic() + within
    while True:
        status, out = gateway.get("/workers")
        if status == 200 and all(w["is_healthy"] for w in out["workers"]):
            return
        assert time.monotonic() < deadline, out
        time.sleep(0.1)


def sglang_generate(
    address: str,
    prompt: list[int],
    room: int,
    bootstrap_port: int,
    request_id: str,
    max_new_tokens: int = NEW_TOKENS,
):
    """A Generate straight to a server's SglangScheduler, as the gateway
    sends each half of a P/D request: (channel, the streaming call)."""
    import grpc

    from tokenbudget.proto import sglang_scheduler_pb2 as sg, sglang_scheduler_pb2_grpc

    channel = grpc.insecure_channel(address)
    request = sg.GenerateRequest(
        request_id=request_id,
        tokenized=sg.TokenizedInput(input_ids=prompt),
        sampling_params=sg.SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=0,
            top_p=1,
            top_k=-1,
            repetition_penalty=1,
            ignore_eos=True,
        ),
        disaggregated_params=sg.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=room
        ),
    )
    stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    return channel, stub.Generate(request, timeout=60)


def sglang_abort(address: str, request_id: str) -> bool:
    """SglangScheduler.Abort on a server, as the gateway sends it; its success."""
    import grpc

    from tokenbudget.proto import sglang_scheduler_pb2 as sg, sglang_scheduler_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        reply = stub.Abort(sg.AbortRequest(request_id=request_id, reason="test"), timeout=10)
    return reply.success


def random_prompts(lengths, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    low, high = len(QWEN_SPECIAL_TOKENS), 1000
    return [rng.integers(low, high, size=n).tolist() for n in lengths]


def hf_greedy(model: str):
    """transformers generate(), greedy, exactly NEW_TOKENS (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def generate(prompt: list[int]) -> list[int]:
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        return ids[0, len(prompt) :].tolist()

    return generate


def body(gateway: Gateway, prompt: list[int], n: int = 1) -> dict:
    return {
        "model": gateway.model,
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "n": n,
        },
    }


def generate(gateway: Gateway, prompt: list[int], n: int = 1, stream: bool = False):
    """Each sample's tokens through ``gateway`` (by sample index)."""
    if stream:
        samples: dict[int, list[int]] = {}
        for event in gateway.stream("/generate", body(gateway, prompt, n)):
            assert "error" not in event, event
            samples.setdefault(event.get("index", 0), []).extend(event["output_ids"])
        return [samples[i] for i in sorted(samples)]
    status, out = gateway.post("/generate", body(gateway, prompt, n))
    assert status == 200, out
    return [sample["output_ids"] for sample in out]


def blocks_in_use(p: Process) -> int:
    with Client(p.address) as client:
        s = client.stats()
    return s.num_total_blocks - s.num_free_blocks


def wait_blocks_in_use(p: Process, within: float) -> None:
    """Until ``p`` holds KV blocks (a decode: its request was admitted and registered)."""
    deadline = time.monotonic() + within
    while not blocks_in_use(p):
        assert time.monotonic() < deadline, f"{p.name} allocated no block within {within} s"
        time.sleep(0.02)


def wait_all_blocks_free(servers: list[Process], within: float) -> None:
    """Until every server holds no request and every KV block is free."""
    deadline = time.monotonic() + within
    while True:
        stats = {}
        for p in servers:
            with Client(p.address) as client:
                stats[p.name] = client.stats()
        if all(
            s.num_free_blocks == s.num_total_blocks and not s.num_requests for s in stats.values()
        ):
            return
        assert time.monotonic() < deadline, {
            n: (s.num_free_blocks, s.num_total_blocks, s.num_requests) for n, s in stats.items()
        }
        time.sleep(0.1)
