"""One request whose parameters break the step fails alone (in-process worker).

The fault is a real one: ``logprobs`` above the vocabulary makes the
sampler's top-k raise after the tokens were drawn, so the bisection must
also give the seeded requests their generators back. The oracle is the same
batch without the bad request.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenbudget.core import Request, RequestOutput, SamplingParams
from tokenbudget.core.failures import RequestFailedError
from tokenbudget.server.entrypoints.llm import LLM

torch.set_num_threads(1)

PROMPTS = [list(range(10 + 7 * i, 30 + 7 * i)) for i in range(3)]
GOOD = [
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, logprobs=2),
]


_ids = itertools.count()


def _run(engine, prompts, params) -> dict[str, list[RequestOutput]]:
    """Drive the engine (past the front's checks) until every request finished."""
    outputs: dict[str, list[RequestOutput]] = {}
    for prompt, p in zip(prompts, params):
        rid = f"r{next(_ids)}"
        outputs[rid] = []
        engine.add_request(Request(rid, prompt, p))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_breaks_the_sampler_fails_alone(tiny_qwen3_path, async_scheduling):
    llm = LLM(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        attention_backend="sdpa",
        num_gpu_blocks=64,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    try:
        runner = engine.executor.worker.model_runner
        want = [_tokens(o) for o in _run(engine, PROMPTS, GOOD).values()]
        bad = SamplingParams(
            max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=runner.vocab_size + 5
        )
        # All four share the first step, where the bad one fails.
        got = list(_run(engine, PROMPTS + [[5, 6, 7]], GOOD + [bad]).values())
        assert [_tokens(o) for o in got[:3]] == want
        assert [o[-1].finish_reason for o in got[:3]] == ["length"] * 3
        (failure,) = got[3]
        assert failure.finish_reason == "error" and failure.new_token_ids == []
        assert isinstance(failure.error, RequestFailedError)
        assert "RuntimeError" in str(failure.error) and ".py" not in str(failure.error)
        sched = engine.scheduler
        pool = sched.kv_cache_manager.block_pool
        pool.check_invariants()
        assert not sched.requests and pool.get_num_free_blocks() == pool.num_blocks - 1
        assert not runner.failed  # the worker forgot it once the scheduler finished it
        # The engine still serves, and the offline API reports the same batch.
        assert [
            r.outputs[0].token_ids
            for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GOOD)
        ] == want
    finally:
        llm.shutdown()


def test_a_failure_every_request_shares_is_a_step_error(tiny_qwen3_path, monkeypatch):
    from tokenbudget.worker import model_runner

    llm = LLM(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        attention_backend="sdpa",
        num_gpu_blocks=64,
        async_scheduling=False,
    )
    try:

        def broken(self, *args, **kwargs):
            raise RuntimeError("the model is broken")

        monkeypatch.setattr(model_runner.ModelRunner, "_forward", broken)
        with pytest.raises(RuntimeError, match="the model is broken"):
            llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS[:2]], SamplingParams(max_tokens=4)
            )
    finally:
        llm.shutdown()


def test_a_request_whose_inputs_cannot_be_prepared_fails_alone(tiny_qwen3_path, monkeypatch):
    from tokenbudget.core.failures import InvalidRequestError
    from tokenbudget.worker import model_runner

    llm = LLM(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        attention_backend="sdpa",
        num_gpu_blocks=64,
        async_scheduling=True,
    )
    engine = llm.engine
    try:
        want = [_tokens(o) for o in _run(engine, PROMPTS, GOOD).values()]
        make_generator = model_runner.make_generator

        def refuse_13(seed, device):
            if seed == 13:
                raise ValueError("seed 13 is not accepted by this device")
            return make_generator(seed, device)

        monkeypatch.setattr(model_runner, "make_generator", refuse_13)
        bad = SamplingParams(max_tokens=8, seed=13)
        got = list(_run(engine, [[9, 9, 9]] + PROMPTS, [bad] + GOOD).values())
        assert [_tokens(o) for o in got[1:]] == want
        (failure,) = got[0]
        assert failure.finish_reason == "error"
        assert isinstance(failure.error, InvalidRequestError)  # gRPC INVALID_ARGUMENT
        assert str(failure.error) == (
            "the request failed: ValueError: seed 13 is not accepted by this device"
        )
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
    finally:
        llm.shutdown()
