"""Shared test setup: one torch thread (a busy 2-core box is 10-20x slower with more)."""
from __future__ import annotations

import contextlib

import pytest

try:
    import torch
except ImportError:  # core-only environments
    torch = None

if torch is not None:
    torch.set_num_threads(1)


@contextlib.contextmanager
def _serving(engine):
    """Host ``engine`` (an AsyncEngine) on the caller's own gRPC server via
    add_generation_servicer, on an ephemeral loopback port; yield a Client.
    The engine is shut down on exit."""
    from concurrent import futures

    import grpc

    from tokenbudget.server.client import Client
    from tokenbudget.server.grpc_service import add_generation_servicer

    server = grpc.server(futures.ThreadPoolExecutor(8))
    add_generation_servicer(server, engine)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = Client(f"127.0.0.1:{port}")
    try:
        yield client
    finally:
        client.close()
        server.stop(0)
        engine.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> str:
    """The tiny random Qwen3 checkpoint (with its trained tokenizer), built once."""
    from tokenbudget.worker.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_qwen3_path):
    """The transformers oracle for tiny_qwen3_path."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def serving():
    return _serving
