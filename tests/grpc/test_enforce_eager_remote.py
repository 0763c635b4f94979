"""enforce_eager reaches a worker behind gRPC: Initialize carries it when the
engine sets it, and leaves it unset (the worker's default) when not."""

from __future__ import annotations

import pytest

from tokenbudget.core import CacheConfig, SchedulerConfig
from tokenbudget.server.executor.remote import RemoteExecutor
from tokenbudget.worker.grpc_worker import serve


@pytest.mark.parametrize("enforce_eager", [True, False, None])
def test_initialize_carries_enforce_eager_to_the_worker_factory(tiny_model, enforce_eager):
    from tokenbudget.worker.worker import Worker

    seen: list[bool | None] = []

    def recording_worker(model, dtype, device, attention_backend, *, enforce_eager, lora_config):
        assert lora_config is None  # LoRA off: Initialize carries no lora_config
        seen.append(enforce_eager)
        # Eager whatever was asked: this test is about the wire, not the compile.
        return Worker(model, dtype=dtype, device=device or None, enforce_eager=True)

    server, port, _ = serve("127.0.0.1", 0, worker_factory=recording_worker)
    executor = RemoteExecutor(
        [f"127.0.0.1:{port}"], tiny_model, device="cpu", enforce_eager=enforce_eager
    )
    try:
        executor.initialize(
            CacheConfig(block_size=16, num_blocks=8), SchedulerConfig(max_model_len=64)
        )
    finally:
        executor.shutdown()
        server.stop(0)
    assert seen == [enforce_eager]
