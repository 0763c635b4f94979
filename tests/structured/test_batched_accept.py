"""Batched token acceptance (one xgrammar call per step for the requests that
sampled one token) against the per-request ``accept_tokens`` path as the
oracle: the same outputs, finish and stop reasons step by step, and the same
matcher states afterwards, across a grammar violation, a grammar that
terminates without a stop token, EOS, a length cap and a request verifying
drafts (several tokens a step, left to the per-request path)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from tokenbudget.core import CacheConfig, Request, SamplingParams, SchedulerConfig
from tokenbudget.core.outputs import ModelRunnerOutput
from tokenbudget.core.scheduler import Scheduler
from tokenbudget.core.structured_output import StructuredOutputManager

CHOICES = ["yes", "no", "maybe"]
EOS = "<|im_end|>"
# Per request: sampling options and the pieces it samples, one list per step
# in which it samples (several pieces: accepted drafts and the bonus token).
SCRIPT = {
    "eos": ({}, [["y"], ["e"], ["s"], [EOS]]),
    "grammar_end": ({"ignore_eos": True}, [["n"], ["o"]]),
    "violation": ({}, [["m"], ["x"]]),
    "capped": ({"max_tokens": 2}, [["m"], ["a"]]),
    "drafts": ({}, [["m"], ["a", "y"], ["b"], ["e"], [EOS]]),
}
DRAFTS = {"drafts": {0: ["a"]}}  # request -> {step: drafts it proposes after that step}


def _ids(tokenizer, pieces: list[str]) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids(pieces)
    assert None not in ids and tokenizer.unk_token_id not in ids
    return ids


def _run(tokenizer, vocab_size: int, batched: bool):
    """Drive a Scheduler with a scripted model; returns the outputs of each step,
    the number of per-request accept calls and the final manager and requests."""
    manager = StructuredOutputManager(tokenizer, vocab_size)
    per_request_calls = []
    accept_tokens = manager.accept_tokens
    manager.accept_tokens = lambda req, ids: (per_request_calls.append(req.request_id),
                                              accept_tokens(req, ids))[1]
    if not batched:
        manager.accept_single_tokens = lambda *args: {}
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=64, num_speculative_tokens=1),
                      CacheConfig(block_size=16, num_blocks=64), manager)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    for rid, (options, _) in SCRIPT.items():
        params = SamplingParams(max_tokens=options.get("max_tokens", 16),
                                ignore_eos=options.get("ignore_eos", False),
                                structured={"choice": CHOICES})
        sched.add_request(Request(rid, [10, 11, 12], params, eos_token_id=eos))
        sched.requests[rid].structured_request.compiled.result(timeout=60)
    requests = dict(sched.requests)
    steps_done = {rid: 0 for rid in SCRIPT}
    history = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        req_ids = list(so.num_scheduled_tokens)
        sampled, proposals = [], []
        for rid in req_ids:
            k = steps_done[rid]
            sampled.append(_ids(tokenizer, SCRIPT[rid][1][k]))
            proposals.append(_ids(tokenizer, DRAFTS.get(rid, {}).get(k, [])))
            steps_done[rid] += 1
        out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
                                spec_token_ids=proposals)
        history.append(sorted((o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason)
                              for o in sched.update_from_output(so, out)))
        assert len(history) < 10, "the script should finish every request"
    return history, per_request_calls, manager, requests


def test_batched_accept_gives_the_per_request_outputs(tokenizer, model_vocab_size, caplog):
    with caplog.at_level(logging.ERROR, logger="tokenbudget.core.structured_output"):
        batched, batched_calls, *_ = _run(tokenizer, model_vocab_size, batched=True)
    batched_errors = [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="tokenbudget.core.structured_output"):
        oracle, oracle_calls, *_ = _run(tokenizer, model_vocab_size, batched=False)
    assert batched == oracle
    assert batched_errors == [r.getMessage() for r in caplog.records]
    assert len(batched_errors) == 1 and "violation" in batched_errors[0]
    final = {o[0]: o[2:] for step in oracle for o in step if o[2] is not None}
    assert final == {"eos": ("stop", None), "grammar_end": ("stop", "grammar"),
                     "violation": ("stop", "grammar"), "capped": ("length", None),
                     "drafts": ("stop", None)}
    # Only the step that verified a draft (two tokens) took the per-request path.
    assert batched_calls == ["drafts"]
    assert len(oracle_calls) == sum(len(steps) for _, steps in SCRIPT.values())


def test_batched_accept_leaves_matchers_in_the_per_request_states(tokenizer, model_vocab_size):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ends = {}
    masks = {}
    for batched in (True, False):
        manager = StructuredOutputManager(tokenizer, model_vocab_size)
        reqs = {}
        for rid, options in (("a", {}), ("b", {"ignore_eos": True}), ("c", {}), ("d", {})):
            req = Request(rid, [10, 11], SamplingParams(structured={"choice": CHOICES},
                                                        **options), eos_token_id=eos)
            manager.add_request(req)
            req.structured_request.compiled.result(timeout=60)
            assert manager.is_ready(req)
            reqs[rid] = req
        manager.accept_tokens(reqs["b"], _ids(tokenizer, ["n"]))
        sampled = {"a": ["m"], "b": ["o"], "c": ["x"], "d": []}  # d: mid-prefill
        tokens = [_ids(tokenizer, p) for p in sampled.values()]
        index = {rid: i for i, rid in enumerate(sampled)}
        if batched:
            ends[batched] = manager.accept_single_tokens(list(sampled), index, tokens)
        else:
            ends[batched] = {rid: manager.accept_tokens(reqs[rid], tokens[index[rid]])
                             for rid in sampled if tokens[index[rid]]}
        masks[batched] = manager.fill_bitmask(["a", "c", "d"], {})
        manager.shutdown()
    assert ends[True] == ends[False] == {"a": False, "b": True, "c": True}
    np.testing.assert_array_equal(masks[True], masks[False])
    # "a" moved on from the start ("maybe" only); the rejected token left "c" there.
    assert not np.array_equal(masks[True][0], masks[True][2])
    np.testing.assert_array_equal(masks[True][1], masks[True][2])


@pytest.mark.parametrize("pieces", [["m", "a"], []])
def test_batched_accept_skips_requests_without_exactly_one_token(tokenizer, model_vocab_size,
                                                                  pieces):
    manager = StructuredOutputManager(tokenizer, model_vocab_size)
    req = Request("r", [10, 11], SamplingParams(structured={"choice": CHOICES}),
                  eos_token_id=tokenizer.convert_tokens_to_ids(EOS))
    manager.add_request(req)
    req.structured_request.compiled.result(timeout=60)
    assert manager.is_ready(req)
    before = manager.fill_bitmask(["r"], {})
    assert manager.accept_single_tokens(["r", "gone"], {"r": 0, "gone": 1},
                                        [_ids(tokenizer, pieces), [5]]) == {}
    np.testing.assert_array_equal(manager.fill_bitmask(["r"], {}), before)
    manager.shutdown()
