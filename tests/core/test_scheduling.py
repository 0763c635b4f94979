"""The token budget: decode and prefill chunks share a step, long prompts are
chunked, and the caps (budget, max_num_seqs, max_model_len) always hold."""

from __future__ import annotations

import pytest


def test_one_step_mixes_decode_tokens_with_a_new_prefill_chunk(make_scheduler, make_request, step):
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    step(s)  # both prefilled, each sampled one token
    s.add_request(make_request("c", 200))

    so, _ = step(s)

    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 62}
    assert so.total_num_scheduled_tokens == 64
    assert [r.req_id for r in so.scheduled_new_reqs] == ["c"]
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]


def test_3000_token_prompt_with_budget_1024_runs_1024_1024_952_then_decodes(
    make_scheduler, make_request, run_to_completion
):
    s = make_scheduler(max_num_batched_tokens=1024)
    s.add_request(make_request("long", 3000, max_tokens=3))

    run = run_to_completion(s)

    assert [sch["long"] for sch in run.schedules] == [1024, 1024, 952, 1, 1]
    assert len(run.tokens["long"]) == 3


def test_long_prefill_threshold_splits_three_prompts_400_400_224(
    make_scheduler, make_request, step
):
    s = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for rid in "abc":
        s.add_request(make_request(rid, 800))

    steps = [step(s)[0].num_scheduled_tokens for _ in range(3)]

    assert steps == [
        {"a": 400, "b": 400, "c": 224},
        {"a": 400, "b": 400, "c": 224},
        {"a": 1, "b": 1, "c": 352},
    ]


def test_running_never_exceeds_max_num_seqs(make_scheduler, make_request, step):
    s = make_scheduler(max_num_seqs=2)
    for rid in "abcd":
        s.add_request(make_request(rid, 4, max_tokens=3))

    so, _ = step(s)

    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c", "d"]


def test_request_stops_at_max_model_len(make_scheduler, make_request, run_to_completion):
    s = make_scheduler(max_model_len=20, max_num_batched_tokens=8)
    s.add_request(make_request("a", 15, max_tokens=100))

    run = run_to_completion(s)

    # Prompt 15 + 5 outputs = 20 = max_model_len; never computes past it.
    assert len(run.tokens["a"]) == 5
    assert run.finish_reasons["a"] == "length"
    assert sum(sch["a"] for sch in run.schedules) == 19


def test_prompt_longer_than_max_model_len_is_rejected(make_scheduler, make_request):
    s = make_scheduler(max_model_len=20)
    with pytest.raises(ValueError, match="21 tokens.*max_model_len=20"):
        s.add_request(make_request("a", 21))


def test_duplicate_request_id_is_rejected(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("a"))
    with pytest.raises(ValueError, match="'a' already exists"):
        s.add_request(make_request("a"))
