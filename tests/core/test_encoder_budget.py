"""Encoder inputs: scheduled in the step that first reaches the placeholder,
cut by the per-step budget, shared by mm_hash, rejected when too large."""

from __future__ import annotations

import pytest


def _encoder_runs(outputs) -> list[tuple[str, int]]:
    return [
        (rid, i) for so in outputs for rid, ids in so.scheduled_encoder_inputs.items() for i in ids
    ]


def test_chunk_stops_before_a_placeholder_the_encoder_budget_cannot_take(
    make_scheduler, make_request, step
):
    s = make_scheduler(
        max_num_batched_tokens=2048, encoder_compute_budget=300, encoder_cache_size=1000
    )
    s.add_request(make_request("first", 300, mm=[("img1", 0, 200)]))
    s.add_request(make_request("second", 400, mm=[("img2", 100, 200)]))

    so, _ = step(s)  # "first" spends 200 of the 300 embeddings

    assert so.scheduled_encoder_inputs == {"first": [0]}
    assert so.num_scheduled_tokens == {"first": 300, "second": 100}

    so, _ = step(s)
    assert so.scheduled_encoder_inputs == {"second": [0]}
    assert so.num_scheduled_tokens == {"first": 1, "second": 300}


def test_two_requests_with_the_same_image_encode_it_once(
    make_scheduler, make_request, step, run_to_completion
):
    s = make_scheduler()
    s.add_request(make_request("r1", 100, mm=[("cat", 10, 50)], max_tokens=2))
    s.add_request(make_request("r2", 100, mm=[("cat", 10, 50)], max_tokens=2))
    run = run_to_completion(s)
    # A later request finds the output still cached after both finished.
    s.add_request(make_request("r3", 100, mm=[("cat", 10, 50)], max_tokens=2))
    later = run_to_completion(s)

    assert _encoder_runs(run.outputs + later.outputs) == [("r1", 0)]
    assert s.encoder_cache_manager.num_encoder_runs == 1


def test_item_larger_than_the_encoder_cache_is_rejected_at_add_request(
    make_scheduler, make_request
):
    s = make_scheduler(encoder_cache_size=100, encoder_compute_budget=1000)
    with pytest.raises(ValueError, match="huge needs 101 encoder embeddings.*100"):
        s.add_request(make_request("r", 200, mm=[("huge", 0, 101)]))
    assert not s.has_unfinished_requests()


def test_placeholder_outside_the_prompt_is_rejected(make_scheduler, make_request):
    s = make_scheduler()
    with pytest.raises(ValueError, match=r"\[90, 110\) lies outside the prompt"):
        s.add_request(make_request("r", 100, mm=[("img", 90, 20)]))


def test_unreferenced_encoder_output_is_evicted_oldest_first_and_announced(
    make_scheduler, make_request, run_to_completion, step
):
    s = make_scheduler(encoder_cache_size=100, encoder_compute_budget=100)
    s.add_request(make_request("r1", 50, mm=[("a", 0, 40)], max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("r2", 50, mm=[("b", 0, 40)], max_tokens=1))
    run_to_completion(s)
    assert s.encoder_cache_manager.num_free_slots == 20

    s.add_request(make_request("r3", 100, mm=[("c", 0, 60)], max_tokens=1))
    so, _ = step(s)

    assert so.free_encoder_mm_hashes == ["a"]
    assert so.scheduled_encoder_inputs == {"r3": [0]}


def test_same_image_twice_in_one_prompt_is_encoded_once_and_frees_its_space(
    make_scheduler, make_request, run_to_completion
):
    s = make_scheduler(encoder_cache_size=100, encoder_compute_budget=100)
    s.add_request(make_request("twice", 80, mm=[("x", 0, 30), ("x", 40, 30)], max_tokens=1))
    run = run_to_completion(s)
    assert _encoder_runs(run.outputs) == [("twice", 0)]

    # The whole cache is reclaimable once "twice" is done.
    s.add_request(make_request("full", 120, mm=[("y", 0, 100)], max_tokens=1))
    run = run_to_completion(s, max_steps=20)
    assert run.finish_reasons == {"full": "length"}


def test_repeated_image_stays_cached_until_its_last_placeholder_is_computed(
    make_scheduler, make_request, run_to_completion
):
    s = make_scheduler(
        encoder_cache_size=100, encoder_compute_budget=100, long_prefill_token_threshold=10
    )
    s.add_request(make_request("twice", 80, mm=[("x", 0, 30), ("x", 40, 30)], max_tokens=1))
    # Reaches its 80-embedding image when "twice" is between its two "x" runs.
    s.add_request(make_request("other", 120, mm=[("y", 30, 80)], max_tokens=1))

    run = run_to_completion(s)

    assert _encoder_runs(run.outputs) == [("twice", 0), ("other", 0)]
    assert set(run.finish_reasons) == {"twice", "other"}
