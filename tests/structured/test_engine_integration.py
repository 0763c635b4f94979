"""Structured requests inside the engine: mixed batches, async scheduling,
errors that reach the caller, and compiles that never stall other requests."""

from __future__ import annotations

import re
import threading

import pytest

from tokenbudget.core import RequestStatus, SamplingParams
from tokenbudget.core.structured.manager import GrammarError, GrammarTimeoutError

REGEX = r"\((add|sub|mul) [0-9]{1,3} [0-9]{1,3}\)"
PROMPTS = [
    "The quick brown fox",
    "Attention lets every position",
    "def fibonacci(n):",
    "SELECT id, name FROM users",
]


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _structured(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured={"regex": REGEX})


@pytest.mark.parametrize("engine", ["llm", "llm_async"])
def test_unstructured_outputs_unchanged_by_structured_neighbours(engine, request, no_leaks):
    llm = request.getfixturevalue(engine)
    alone = llm.generate(PROMPTS, _greedy())
    mixed_prompts = [p for pair in zip(PROMPTS, ["Answer:"] * len(PROMPTS)) for p in pair]
    mixed_params = [p for i in range(len(PROMPTS)) for p in (_greedy(), _structured(i))]
    mixed = llm.generate(mixed_prompts, mixed_params)
    assert [m.token_ids for m in mixed[0::2]] == [a.token_ids for a in alone]
    for m in mixed[1::2]:
        assert m.finish_reason == "stop" and re.fullmatch(REGEX, m.text), m.text
    no_leaks(llm)


def test_async_scheduling_bitmask_follows_the_previous_token(llm_async, no_leaks):
    # Under overlap scheduling a bitmask computed before step N's token is
    # accepted would let invalid continuations through.
    outs = llm_async.generate(["Answer:"] * 24, [_structured(100 + s) for s in range(24)])
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    no_leaks(llm_async)


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({"json_schema": '{"type": "object", "properties": '}, r"json_schema is not valid JSON"),
        ({"json_schema": {"type": "nope"}}, r"json_schema: .*nope"),
        ({"regex": "[a-"}, r"regex: .*Unclosed '\['"),
        ({"grammar": 'root ::= item\nitem ::= "a" missing'}, r"grammar: .*missing.* not defined"),
    ],
)
def test_invalid_spec_is_a_clear_error_and_leaves_the_engine_healthy(llm, spec, problem, no_leaks):
    ok = SamplingParams(temperature=0.0, max_tokens=4)
    bad = SamplingParams(max_tokens=8, structured=spec)
    with pytest.raises(ValueError, match=problem):
        llm.generate(["Hello", "Answer:"], [ok, bad])
    no_leaks(llm)
    outs = llm.generate(["Hello", "Answer:"], [ok, _structured(0)])
    assert outs[0].finish_reason in ("stop", "length")
    assert re.fullmatch(REGEX, outs[1].text)
    no_leaks(llm)


def test_compile_failure_after_submission_aborts_only_that_request(llm, monkeypatch, no_leaks):
    # A spec that parses but fails to compile: the error reaches generate().
    def failing(params):
        raise GrammarError(f"structured.{params.kind}: injected compile failure")

    monkeypatch.setattr(llm.structured_output, "compile", failing)
    spec = SamplingParams(max_tokens=16, structured={"regex": "late-fail-[0-9]"})
    with pytest.raises(ValueError, match="injected compile failure"):
        llm.generate(["Hello", "Answer:"], [SamplingParams(max_tokens=4), spec])
    no_leaks(llm)
    monkeypatch.undo()
    # The failure was not cached: the same spec compiles now.
    out = llm.generate("Answer:", spec)[0]
    assert re.fullmatch("late-fail-[0-9]", out.text) and out.finish_reason == "stop"


def _run_until(engine, done, max_steps: int = 500) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if done(outputs):
            return outputs
    raise AssertionError(f"not done after {max_steps} steps: {outputs}")


def _finished(outputs, rid) -> bool:
    return any(o.finished for o in outputs.get(rid, ()))


def test_compiling_request_does_not_block_later_requests(llm, monkeypatch, no_leaks):
    manager, engine = llm.structured_output, llm.engine
    release = threading.Event()
    real_compile = manager.compile

    def slow_compile(params):
        release.wait(30)
        return real_compile(params)

    monkeypatch.setattr(manager, "compile", slow_compile)
    [slow] = llm._make_requests(
        "Answer:",
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=64, structured={"regex": r"slow-[0-9]{2}"}
        ),
    )[1]
    fast = [llm._make_requests(p, _greedy(8))[1][0] for p in PROMPTS]
    engine.add_request(slow)  # first in the queue
    for r in fast:
        engine.add_request(r)
    try:
        _run_until(engine, lambda outs: all(_finished(outs, r.request_id) for r in fast))
        assert slow.status == RequestStatus.WAITING_FOR_FSM
        assert slow in list(engine.scheduler.waiting)
    finally:
        release.set()
    outs = _run_until(engine, lambda outs: _finished(outs, slow.request_id))
    text = llm.input_processor.decode([t for o in outs[slow.request_id] for t in o.new_token_ids])
    assert re.fullmatch(r"slow-[0-9]{2}", text), text
    no_leaks(llm)


def test_compile_timeout_aborts_with_a_clear_reason(llm, monkeypatch, no_leaks):
    manager = llm.structured_output
    release = threading.Event()
    real_compile = manager.compile
    # A real grammar once released: the compile cache sizes what it keeps.
    monkeypatch.setattr(
        manager, "compile", lambda params: release.wait(30) and real_compile(params)
    )
    monkeypatch.setattr(manager, "compile_timeout_s", 0.2)
    try:
        with pytest.raises(GrammarTimeoutError, match=r"regex: .*did not compile within 0.2 s"):
            llm.generate(
                ["Hello", "Answer:"],
                [_greedy(4), SamplingParams(max_tokens=8, structured={"regex": "timeout-[0-9]"})],
            )
    finally:
        release.set()
    no_leaks(llm)
