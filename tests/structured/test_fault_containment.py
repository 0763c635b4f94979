"""A structured request whose grammar matcher fails (cannot be built, or
cannot fill its bitmask) fails alone: the others of its steps get the tokens
they get without it, and nothing leaks (issue 10, defect 0)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tokenbudget.core import Request, SamplingParams
from tokenbudget.core.structured.manager import StructuredOutputManager

REGEX = r"\((add|sub|mul) [0-9]{1,3} [0-9]{1,3}\)"
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34]]
_ids = itertools.count()


def _params(seed: int, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=40, structured={"regex": REGEX}, **extra
    )


GOOD = [_params(1), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), _params(2)]


def _run(llm, prompts, params) -> list[tuple[list[int], str | None, Exception | None]]:
    """Through the engine (past the front's checks): tokens, finish reason, error."""
    rids = []
    for prompt, p in zip(prompts, params):
        rids.append(f"s{next(_ids)}")
        llm.engine.add_request(Request(rids[-1], prompt, p, eos_token_id=llm.eos_token_ids[0]))
    got = {rid: ([], None, None) for rid in rids}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens, _, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)
    return [got[r] for r in rids]


@pytest.mark.parametrize("engine", ["llm", "llm_async"])
def test_a_matcher_that_cannot_be_built_fails_its_request_alone(
    engine, request, no_leaks, model_vocab_size
):
    llm = request.getfixturevalue(engine)
    want = _run(llm, PROMPTS, GOOD)
    # xgrammar refuses a stop token outside the vocabulary when it builds the matcher.
    bad = _params(3, stop_token_ids=[model_vocab_size + 100])
    got = _run(llm, PROMPTS + [[41, 42]], GOOD + [bad])
    assert got[:3] == want
    tokens, reason, error = got[3]
    assert tokens == [] and reason == "error"
    # xgrammar's message, without its source file and line.
    assert "stop token id" in str(error) and "grammar_matcher.cc" not in str(error)
    no_leaks(llm)


@pytest.mark.parametrize("engine", ["llm", "llm_async"])
def test_a_matcher_that_cannot_fill_its_bitmask_fails_its_request_alone(
    engine, request, no_leaks, monkeypatch
):
    llm = request.getfixturevalue(engine)
    want = _run(llm, PROMPTS, GOOD)
    make_matcher = StructuredOutputManager._make_matcher

    class Broken:
        """A matcher whose bitmask fill fails, as a corrupted one would."""

        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name: str):
            if name.startswith("_"):  # no native handle: the batched fill fails on it too
                raise AttributeError(name)
            return getattr(self.inner, name)

        def fill_next_token_bitmask(self, *args):
            raise RuntimeError("matcher state corrupted")

    def faulty(req, compiled):
        matcher = make_matcher(req, compiled)
        return Broken(matcher) if req.sampling_params.seed == 77 else matcher

    monkeypatch.setattr(StructuredOutputManager, "_make_matcher", staticmethod(faulty))
    got = _run(llm, PROMPTS + [[41, 42]], GOOD + [_params(77)])
    assert got[:3] == want
    tokens, reason, error = got[3]
    assert tokens == [] and reason == "error"
    assert "RuntimeError: matcher state corrupted" in str(error)
    no_leaks(llm)


@pytest.mark.parametrize("engine", ["llm", "llm_async"])
def test_a_token_its_grammar_rejects_fails_the_request_and_is_not_output(
    engine, request, no_leaks, monkeypatch
):
    """A worker that does not apply the grammar bitmask (its executor gets every step without
    one): greedy, the model's first token is not the regex's "(", so the structured request
    fails with finish reason "error" and a clear error, and that token is not output; the
    request beside it gets its tokens.

    Break this catches (tried): accept_tokens ending the request as a normal stop on a refused
    token (the old rule): the token was output and the finish reason was "stop"."""
    llm = request.getfixturevalue(engine)
    greedy_regex = SamplingParams(temperature=0.0, max_tokens=40, structured={"regex": REGEX})
    first = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0, max_tokens=1)
    )[0].text
    assert not first.startswith("(")  # the grammar refuses the model's own choice
    want = _run(llm, PROMPTS[1:2], GOOD[1:2])
    executor = llm.engine.executor
    send = executor.execute_model
    monkeypatch.setattr(
        executor, "execute_model", lambda so: send(dataclasses.replace(so, grammar_bitmask=None))
    )
    got = _run(llm, PROMPTS[:2], [greedy_regex, GOOD[1]])
    assert got[1:] == want
    tokens, reason, error = got[0]
    assert tokens == [] and reason == "error"
    assert "grammar does not allow" in str(error) and "bitmask" in str(error)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy_regex)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([], "", "error")
    assert "grammar does not allow" in out.error
    no_leaks(llm)
