"""Pooling (embedding) requests in the scheduler: prefill only, finished with
the worker's pooled vector in the step their prompt completes, beside
generation requests; MEAN and CLS never read the prefix cache."""

from __future__ import annotations

import pytest

from tokenbudget.core import ModelRunnerOutput, PoolingParams, Request, SamplingParams
from tokenbudget.core.failures import UnsupportedRequestError


def pooling_request(rid: str, prompt: list[int], kind: str = "MEAN") -> Request:
    return Request(rid, prompt, None, pooling_params=PoolingParams(kind, True))


class PoolingModel:
    """The fake model, plus what a worker does for pooling requests: sample
    nothing, and pool (here: the prompt length) once the prompt is computed.
    ``computed`` records each pooling chunk [start, end)."""

    def __init__(self, fake_model) -> None:
        self.inner = fake_model()
        self.chunks: dict[str, list[tuple[int, int]]] = {}

    def __call__(self, scheduler, so) -> ModelRunnerOutput:
        out = self.inner(scheduler, so)
        pooled = [None] * len(out.req_ids)
        for i, rid in enumerate(out.req_ids):
            req = scheduler.requests[rid]
            if req.pooling_params is None:
                continue
            end = req.num_computed_tokens
            self.chunks.setdefault(rid, []).append((end - so.num_scheduled_tokens[rid], end))
            out.sampled_token_ids[i] = []
            if end >= req.num_tokens:
                pooled[i] = [float(req.num_prompt_tokens)]
        out.pooler_output = pooled
        return out


def test_pooling_request_is_prefill_only_beside_generation(
    make_scheduler, make_request, run_to_completion, fake_model
):
    s = make_scheduler(max_num_batched_tokens=16, block_size=4)
    s.add_request(make_request("gen", 5, max_tokens=6))
    s.add_request(pooling_request("emb", list(range(40))))
    model = PoolingModel(fake_model)
    run = run_to_completion(s, model)
    assert run.finish_reasons == {"gen": "length", "emb": "stop"}
    assert run.tokens["emb"] == [] and len(run.tokens["gen"]) == 6
    # Chunks in order from 0, covering the prompt exactly once, never a decode step.
    chunks = model.chunks["emb"]
    assert chunks[0][0] == 0 and chunks[-1][1] == 40 and len(chunks) >= 3
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    # Some step computed a pooling chunk next to the generation's decode.
    assert any(sched.get("gen") == 1 and "emb" in sched for sched in run.schedules)
    assert (
        not s.requests
        and s.kv_cache_manager.block_pool.get_num_free_blocks()
        == s.kv_cache_manager.block_pool.num_blocks - 1
    )


def test_the_vector_comes_out_on_the_final_output(make_scheduler, step, fake_model):
    s = make_scheduler(max_num_batched_tokens=8, block_size=4)
    s.add_request(pooling_request("emb", list(range(20))))
    model = PoolingModel(fake_model)
    outs = []
    while s.has_unfinished_requests():
        outs += step(s, model)[1]
    assert [(o.request_id, o.finish_reason, o.pooling_output) for o in outs] == [
        ("emb", "stop", [20.0])
    ]


@pytest.mark.parametrize("kind,cached", [("LAST", 16), ("MEAN", 0), ("CLS", 0)])
def test_only_last_token_pooling_reads_the_prefix_cache(
    make_scheduler, make_request, run_to_completion, fake_model, kind, cached
):
    s = make_scheduler(block_size=8)
    prompt = list(range(100, 120))
    s.add_request(make_request("warm", prompt, max_tokens=1))
    run_to_completion(s)
    s.add_request(pooling_request("emb", prompt, kind))
    model = PoolingModel(fake_model)
    run_to_completion(s, model)
    assert model.chunks["emb"] == [(cached, 20)]


def test_async_never_schedules_past_the_prompt(make_scheduler, fake_model):
    """With output placeholders the pooling request looks like one that
    awaits its only token: the next step leaves it alone until its vector
    arrives."""
    s = make_scheduler(async_scheduling=True, block_size=4)
    s.add_request(pooling_request("emb", list(range(10))))
    s.add_request(Request("gen", list(range(50, 55)), SamplingParams(max_tokens=3)))
    model = PoolingModel(fake_model)
    first = s.schedule()
    out1 = model(s, first)
    second = s.schedule()
    assert "emb" not in second.num_scheduled_tokens and "gen" in second.num_scheduled_tokens
    done = s.update_from_output(first, out1)
    assert {o.request_id: o.finish_reason for o in done} == {"emb": "stop", "gen": None}
    s.update_from_output(second, model(s, second))
    assert "emb" not in s.requests


def test_a_worker_that_samples_instead_of_pooling_fails_the_request(
    make_scheduler, step, fake_model
):
    """A worker that ignores pooling_params (an older one) samples a token
    when the prompt completes: the request fails with the reason, rather than
    waiting forever for a vector, and frees its blocks."""
    s = make_scheduler(block_size=4)
    s.add_request(pooling_request("emb", list(range(10))))
    _, outs = step(s, fake_model())
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [
        ("emb", "abort", [])
    ]
    assert isinstance(outs[0].error, UnsupportedRequestError)  # gRPC UNIMPLEMENTED
    assert "does not support pooling" in str(outs[0].error)
    assert not s.requests and not s.running
    s.kv_cache_manager.block_pool.check_invariants()


def test_pooling_params_are_checked_on_the_request():
    with pytest.raises(ValueError, match="must be resolved"):
        Request("r", [1, 2], None, pooling_params=PoolingParams("MEAN"))
    with pytest.raises(ValueError, match="give sampling_params or pooling_params, not both"):
        Request("r", [1, 2], SamplingParams(), pooling_params=PoolingParams("MEAN", True))
    with pytest.raises(ValueError, match="sampling_params must be given"):
        Request("r", [1, 2], None)
