"""Async scheduling with a deferred grammar bitmask: the in-process executor
gets step N+1 before step N's tokens are applied, and its worker waits for the
mask only right before sampling. Oracle: the sync engine's tokens."""

from __future__ import annotations

import re
from concurrent.futures import Future

import numpy as np
import pytest

from tokenbudget.core import SamplingParams

REGEX = r"\((add|sub|mul) [0-9]{1,3} [0-9]{1,3}\)"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
PROMPTS = [
    "The quick brown fox",
    "Answer:",
    "def fibonacci(n):",
    "{",
    "SELECT id FROM t",
    "Result:",
]


def _mixed(temperature: float) -> list[SamplingParams]:
    """Unstructured rows between structured ones (regex and JSON) that end
    at different steps, so some finish while the next step is in flight."""
    kinds = [None, {"regex": REGEX}, None, {"json_schema": SCHEMA}, None, {"regex": REGEX}]
    return [
        SamplingParams(
            temperature=temperature,
            seed=7 + i if temperature else None,
            max_tokens=40,
            ignore_eos=kind is None,
            structured=kind,
        )
        for i, kind in enumerate(kinds)
    ]


def _assert_well_formed(outs, params) -> None:
    for o, p in zip(outs, params):
        if p.structured is not None and p.structured.regex is not None:
            assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_deferred_bitmask_gives_the_sync_tokens(llm, llm_async, temperature, no_leaks):
    assert llm_async.engine._defer_masks, "the in-process async executor must defer masks"
    params = _mixed(temperature)
    sync = llm.generate(PROMPTS, params)
    overlapped = llm_async.generate(PROMPTS, params)
    assert [(o.token_ids, o.finish_reason) for o in overlapped] == [
        (o.token_ids, o.finish_reason) for o in sync
    ]
    _assert_well_formed(overlapped, params)
    no_leaks(llm_async)


class _Recorded:
    """The executor's future; records when the engine consumes the result."""

    def __init__(self, fut: Future, step: int, events: list) -> None:
        self._fut, self._step, self._events = fut, step, events

    def result(self, timeout=None):
        out = self._fut.result(timeout)
        self._events.append(("result", self._step))
        return out

    def cancel(self) -> bool:
        return self._fut.cancel()


def test_next_step_is_sent_before_the_structured_step_is_applied(llm_async, monkeypatch):
    executor = llm_async.engine.executor
    events: list[tuple[str, int]] = []
    structured: dict[int, bool] = {}
    pending_at_send: dict[int, bool] = {}
    send = executor.execute_model

    def execute_model(so):
        step = len(structured)
        structured[step] = bool(so.structured_req_ids)
        mask = so.grammar_bitmask
        pending_at_send[step] = isinstance(mask, Future) and not mask.done()
        events.append(("send", step))
        return _Recorded(send(so), step, events)

    monkeypatch.setattr(executor, "execute_model", execute_model)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=32, structured={"regex": REGEX})
        for s in range(8)
    ]
    llm_async.generate(["Answer:"] * 8, params)
    order = {event: i for i, event in enumerate(events)}
    # Step N+1 went out while structured step N was still unapplied.
    overlapped = [
        n
        for n in structured
        if structured[n]
        and ("send", n + 1) in order
        and order[("send", n + 1)] < order[("result", n)]
    ]
    assert len(overlapped) >= len([n for n in structured if structured[n]]) // 2, events
    # ... carrying a mask that could not be known yet.
    assert all(pending_at_send[n + 1] for n in overlapped if structured[n + 1])


def test_executor_without_opt_in_gets_a_concrete_mask(tiny_model, llm, monkeypatch):
    """A remote-style executor (wire conversion, no ``defers_grammar_bitmask``)
    keeps today's behaviour: an array it can encode, and the sync tokens."""
    from tokenbudget.proto.step_stream import SchedulerOutputDecoder, SchedulerOutputEncoder
    from tokenbudget.server import LLM
    from tokenbudget.server.executor import inprocess as executor_module

    masks = []

    class RemoteStyle(executor_module.InProcessExecutor):
        def __init__(self, worker, *, async_mode=False):
            super().__init__(worker, async_mode=async_mode)
            del self.defers_grammar_bitmask
            self._encoder, self._decoder = SchedulerOutputEncoder(), SchedulerOutputDecoder()

        def execute_model(self, so):
            masks.append(so.grammar_bitmask)
            return super().execute_model(self._decoder.decode(self._encoder.encode(so)))

    monkeypatch.setattr(executor_module, "InProcessExecutor", RemoteStyle)
    remote = LLM(
        tiny_model, num_gpu_blocks=512, max_num_seqs=64, max_model_len=1024, async_scheduling=True
    )
    try:
        assert not remote.engine._defer_masks
        params = _mixed(1.0)
        got = remote.generate(PROMPTS, params)
    finally:
        remote.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(PROMPTS, params)]
    structured_masks = [m for m in masks if m is not None]
    assert structured_masks and all(isinstance(m, np.ndarray) for m in structured_masks)
