"""No request can wedge the scheduler: one that can never be completed, even
alone in the KV cache, is finished with an error, and the requests queued
behind it run (issue 10, defect 1)."""

from __future__ import annotations

from tokenbudget.core import RequestStatus


def test_a_request_outgrowing_the_whole_cache_fails_and_the_queue_behind_it_runs(
    make_scheduler, make_request, run_to_completion
):
    # 4 usable blocks of 16 = 64 tokens. A's prompt fits, prompt + max_tokens does not.
    s = make_scheduler(num_blocks=5, block_size=16, max_num_batched_tokens=32)
    a = make_request("a", 40, max_tokens=100, ignore_eos=True)
    b = make_request("b", 8, max_tokens=4, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    run = run_to_completion(s, max_steps=500)
    assert run.finish_reasons == {"a": "error", "b": "length"}
    assert len(run.tokens["b"]) == 4
    # A got as far as the cache allows, then a clear error.
    assert a.status == RequestStatus.FINISHED_ERROR and a.num_tokens == 65
    assert "64 tokens" in a.stop_reason and "max_tokens" in a.stop_reason
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 4


def test_the_admission_reserve_does_not_keep_an_idle_engine_waiting(
    make_scheduler, make_request, run_to_completion
):
    # lpm reserves room for the running requests' expected growth, and for the
    # admitted one's own: a long max_tokens exceeds any small cache, but an
    # idle engine must admit it anyway.
    s = make_scheduler(num_blocks=9, block_size=16, policy="lpm")
    s.add_request(make_request("long", 20, max_tokens=100, ignore_eos=True))  # 120 of 128
    s.add_request(make_request("short", 8, max_tokens=3, ignore_eos=True))
    run = run_to_completion(s, max_steps=1000)
    assert run.finish_reasons == {"long": "length", "short": "length"}
    assert len(run.tokens["long"]) == 100


def test_drafts_never_ask_for_more_than_the_cache_holds(
    make_scheduler, make_request, run_to_completion, fake_model
):
    # 64 tokens of KV and 3 draft slots: the request can grow to 61 tokens.
    # Drafts past that would preempt it (recomputing it) again and again.
    s = make_scheduler(
        num_blocks=5,
        block_size=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    req = make_request("r", 40, max_tokens=100, ignore_eos=True)
    s.add_request(req)
    run = run_to_completion(s, fake_model(drafts=lambda r: [1, 2, 3]), max_steps=200)
    assert run.finish_reasons == {"r": "error"} and req.num_tokens == 62
    assert s.num_preemptions <= 1
