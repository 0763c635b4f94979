"""Aborts free at once and are announced; stop rules end requests with the
right reason and keep exactly the tokens up to the stop."""

from __future__ import annotations

import pytest

from tokenbudget.core import RequestStatus

from tokenbudget.core.stop import check_stop


@pytest.mark.parametrize("where", ["waiting", "running"])
def test_abort_frees_blocks_at_once_and_is_announced_next_step(
    make_scheduler, make_request, step, where
):
    s = make_scheduler(block_size=4, num_blocks=11, max_num_seqs=1)
    s.add_request(make_request("running", 20))
    s.add_request(make_request("waiting", 20))
    step(s)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 10 - 5  # 20 computed tokens: 5 blocks

    assert s.finish_requests(where, RequestStatus.FINISHED_ABORTED) == [where]

    assert pool.get_num_free_blocks() == (10 if where == "running" else 5)
    assert where not in s.requests
    assert all(r.request_id != where for r in list(s.waiting) + s.running)
    pool.check_invariants()
    so, _ = step(s)
    assert so.finished_req_ids == {where}
    assert where not in so.num_scheduled_tokens
    so, _ = step(s)
    assert so.finished_req_ids == set()


def test_abort_of_unknown_or_finished_request_is_a_no_op(
    make_scheduler, make_request, run_to_completion
):
    s = make_scheduler()
    s.add_request(make_request("done", 4, max_tokens=1))
    run_to_completion(s)
    assert s.finish_requests(["done", "never"], RequestStatus.FINISHED_ABORTED) == []


def _run_scripted(
    make_scheduler,
    make_request,
    fake_model,
    run_to_completion,
    script,
    max_model_len=1000,
    **sampling,
):
    s = make_scheduler(max_model_len=max_model_len)
    s.add_request(make_request("r", 10, eos=2, **sampling))
    run = run_to_completion(s, fake_model(script={"r": list(script)}))
    return run.tokens["r"], run.finish_reasons["r"]


@pytest.mark.parametrize(
    "sampling, expected_tokens, reason",
    [
        ({}, [5, 6, 2], "stop"),  # EOS ends, and is kept
        ({"ignore_eos": True, "max_tokens": 5}, [5, 6, 2, 7, 2], "length"),
        ({"stop_token_ids": [6]}, [5, 6], "stop"),
        ({"min_tokens": 4, "max_tokens": 6, "stop_token_ids": [6]}, [5, 6, 2, 7, 2], "stop"),
        ({"max_tokens": 2}, [5, 6], "length"),
    ],
)
def test_stop_rules(
    make_scheduler, make_request, fake_model, run_to_completion, sampling, expected_tokens, reason
):
    tokens, finish = _run_scripted(
        make_scheduler,
        make_request,
        fake_model,
        run_to_completion,
        [5, 6, 2, 7, 2, 8, 9],
        **sampling,
    )
    assert (tokens, finish) == (expected_tokens, reason)


def test_request_reaching_max_model_len_is_length_capped(
    make_scheduler, make_request, fake_model, run_to_completion
):
    tokens, finish = _run_scripted(
        make_scheduler,
        make_request,
        fake_model,
        run_to_completion,
        [5, 6, 7, 8],
        max_model_len=13,
        max_tokens=100,
    )
    assert (tokens, finish) == ([5, 6, 7], "length")


def test_stop_token_sets_stop_reason_and_eos_does_not(make_scheduler, make_request):
    req = make_request("r", 4, eos=2, stop_token_ids=[6], max_tokens=10)
    status, kept = check_stop(req, [5, 6, 7], max_model_len=100)
    assert (status, kept, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, [5, 6], 6)
    assert req.output_token_ids == [5, 6]

    req = make_request("e", 4, eos=2, max_tokens=10)
    status, kept = check_stop(req, [2, 7], max_model_len=100)
    assert (status, kept, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, [2], None)


def test_finished_request_output_carries_finish_reason_and_cached_tokens(
    make_scheduler, make_request, run_to_completion, step
):
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", list(range(1, 10)), max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("b", list(range(1, 10)), max_tokens=1))
    _, outs = step(s)
    assert len(outs) == 1
    assert (outs[0].finish_reason, outs[0].num_cached_tokens) == ("length", 8)
