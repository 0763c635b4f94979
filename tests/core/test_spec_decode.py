"""Speculative decoding: drafts are scheduled for verification, rejected ones
roll back num_computed_tokens, and tokens past a stop are dropped."""

from __future__ import annotations

from tokenbudget.core import ModelRunnerOutput

DRAFTS = [101, 102, 103]


def _drafting_scheduler(make_scheduler, make_request, **sampling):
    s = make_scheduler(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3}, block_size=4
    )
    s.add_request(make_request("r", 8, **sampling))
    return s, s.requests["r"]


def test_scheduled_drafts_appear_in_the_output(make_scheduler, make_request, fake_model, step):
    s, r = _drafting_scheduler(make_scheduler, make_request, max_tokens=20)
    model = fake_model(drafts=lambda req: list(DRAFTS))
    step(s, model)  # prefill; the drafter proposes three tokens
    assert r.spec_token_ids == DRAFTS

    so, _ = step(s, model)

    assert so.scheduled_spec_decode_tokens == {"r": DRAFTS}
    assert so.num_scheduled_tokens == {"r": 4}
    # Slots for the drafts' KV were allocated: 9 tokens + 3 drafts = 12 = 3 blocks.
    assert len(s.kv_cache_manager.get_block_ids("r")) >= 3


def test_rejected_drafts_roll_back_num_computed_tokens(
    make_scheduler, make_request, fake_model, step
):
    s, r = _drafting_scheduler(make_scheduler, make_request, max_tokens=20)
    model = fake_model(drafts=lambda req: list(DRAFTS), accept={"r": 1})
    step(s, model)
    assert (r.num_tokens, r.num_computed_tokens) == (9, 8)

    _, outs = step(s, model)  # verifies 4 positions, accepts 1 draft + 1 bonus token

    assert outs[0].new_token_ids[0] == 101 and len(outs[0].new_token_ids) == 2
    assert r.num_tokens == 11
    assert r.num_computed_tokens == 10  # the bonus token is not computed yet
    so, _ = step(s, model)
    assert so.num_scheduled_tokens == {"r": 4}  # 1 new position + 3 fresh drafts


def test_tokens_past_a_stop_token_are_trimmed(make_scheduler, make_request, fake_model, step):
    s, r = _drafting_scheduler(make_scheduler, make_request, max_tokens=20, stop_token_ids=[102])
    model = fake_model(drafts=lambda req: list(DRAFTS))
    _, first = step(s, model)

    _, outs = step(s, model)  # all drafts accepted: 101, 102, 103, bonus

    assert outs[0].new_token_ids == [101, 102]
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 102
    assert r.output_token_ids == first[0].new_token_ids + [101, 102]
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 999


def test_drafts_never_exceed_max_tokens(make_scheduler, make_request, fake_model, step):
    s, r = _drafting_scheduler(make_scheduler, make_request, max_tokens=3)
    model = fake_model(drafts=lambda req: list(DRAFTS))
    step(s, model)  # 1 output token; 2 more allowed, one of them the bonus token

    so, outs = step(s, model)

    assert so.scheduled_spec_decode_tokens == {"r": [101]}
    assert len(outs[0].new_token_ids) == 2 and outs[0].finish_reason == "length"
    assert r.num_output_tokens == 3


def test_a_step_without_new_drafts_schedules_no_stale_ones(
    make_scheduler, make_request, fake_model, step
):
    s, r = _drafting_scheduler(make_scheduler, make_request, max_tokens=20)
    proposals = [list(DRAFTS)]
    model = fake_model(drafts=lambda req: proposals.pop() if proposals else [])
    step(s, model)
    step(s, model)  # verifies the drafts; the drafter has nothing new

    so, _ = step(s, model)

    assert so.scheduled_spec_decode_tokens == {}
    assert so.num_scheduled_tokens == {"r": 1}


def _output(rid: str, tokens: list[int], drafts: list[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput([rid], {rid: 0}, [tokens], spec_token_ids=[drafts])


def test_async_drops_drafts_a_step_in_flight_made_stale_and_spends_scheduled_ones(
    make_scheduler, make_request
):
    s = make_scheduler(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        block_size=4,
        async_scheduling=True,
    )
    s.add_request(make_request("r", 8, max_tokens=20))
    r = s.requests["r"]
    so1 = s.schedule()  # the prompt; samples output 0
    so2 = s.schedule()  # output 0's decode, sent before so1's output is known
    assert so2.num_scheduled_tokens == {"r": 1}

    s.update_from_output(so1, _output("r", [5], [6, 7, 8]))
    # Proposed to follow token 5, but so2 (in flight) appends a token first: stale.
    assert (s.num_stale_drafts, r.spec_token_ids) == (1, [])
    s.update_from_output(so2, _output("r", [6], [7, 8, 9]))
    assert (s.num_stale_drafts, r.spec_token_ids) == (0, [7, 8, 9])

    so3 = s.schedule()
    assert so3.scheduled_spec_decode_tokens == {"r": [7, 8, 9]}
    assert so3.num_scheduled_tokens == {"r": 4}
    assert r.spec_token_ids == []  # spent
    so4 = s.schedule()  # while so3 verifies: nothing of r's is known yet
    assert "r" not in so4.num_scheduled_tokens

    s.update_from_output(so3, _output("r", [7, 8, 1], [2, 3, 4]))  # 2 drafts + 1 accepted
    assert r.output_token_ids == [5, 6, 7, 8, 1]
    assert (r.num_computed_tokens, r.num_output_placeholders) == (12, 0)
    assert r.spec_token_ids == [2, 3, 4]
    assert s.make_stats().spec_decoding.accepted_per_position == [1, 1]
