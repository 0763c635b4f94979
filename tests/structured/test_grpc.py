"""Structured output over the Generation gRPC service (in-process server via
add_generation_servicer, async scheduling): constrained requests stream valid
text, a bad spec is INVALID_ARGUMENT naming the problem, and a grammar that
does not compile in time ends the call with DEADLINE_EXCEEDED."""

from __future__ import annotations

import json
import re
import threading

import grpc
import pytest

from tokenbudget.core import CacheConfig, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.server.engine.async_engine import AsyncEngine

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(tiny_model, serving):
    from tokenbudget.core.structured.manager import StructuredOutputManager
    from tokenbudget.server.engine.input_processor import InputProcessor
    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker

    executor = InProcessExecutor(Worker(tiny_model), async_mode=True)
    processor = InputProcessor.from_pretrained(tiny_model)
    # The manager goes to the EngineCore, as the engine factory gives it.
    core = EngineCore(
        SchedulerConfig(max_model_len=1024, async_scheduling=True),
        CacheConfig(num_blocks=256),
        executor,
        StructuredOutputManager(processor.tokenizer, processor.vocab_size),
    )
    engine = AsyncEngine(core, processor, model_name="tiny")
    with serving(engine) as client:
        yield client, engine


def test_structured_requests_over_grpc(served):
    client, engine = served
    outs = [
        client.generate(
            "Answer:", SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured=spec)
        )
        for s, spec in enumerate(
            [
                {"json_schema": SCHEMA},
                {"regex": r"[A-Z]{2}-[0-9]{3}"},
                {"choice": ["left", "right"]},
            ]
        )
    ]
    assert all(o.finish_reason == "stop" for o in outs), outs
    parsed = json.loads(outs[0].text)
    assert set(parsed) == {"ok", "n"} and isinstance(parsed["ok"], bool)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", outs[1].text)
    assert outs[2].text in ("left", "right")
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    assert engine.wait_idle(10)
    pool.check_invariants()


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({"regex": "(unclosed"}, r"sampling_params\.structured\.regex: .*"),
        (
            {"json_schema": "{not json"},
            r"sampling_params\.structured\.json_schema is not valid JSON",
        ),
    ],
)
def test_invalid_spec_is_invalid_argument(served, spec, problem):
    client, _ = served
    with pytest.raises(grpc.RpcError) as err:
        client.generate("Answer:", SamplingParams(max_tokens=8, structured=spec))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.match(problem, err.value.details()), err.value.details()
    # The server still serves.
    assert client.generate(
        "Answer:", SamplingParams(max_tokens=8, structured={"choice": ["a", "b"]})
    ).text in ("a", "b")


def test_compile_timeout_is_deadline_exceeded(served, monkeypatch):
    client, engine = served
    manager = engine.core.scheduler.structured_output_manager
    release = threading.Event()
    real_compile = manager.compile
    # A real grammar once released: the compile cache sizes what it keeps.
    monkeypatch.setattr(
        manager, "compile", lambda params: release.wait(30) and real_compile(params)
    )
    monkeypatch.setattr(manager, "compile_timeout_s", 0.2)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(
                "Answer:", SamplingParams(max_tokens=8, structured={"regex": "grpc-timeout"})
            )
    finally:
        release.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not compile within 0.2 s" in err.value.details()
