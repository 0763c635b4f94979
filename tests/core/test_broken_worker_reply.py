"""A worker reply without a token for a request that had to sample is a step
error with a clear message, never a request left unscheduled for ever
(issue 10, defect 5)."""

from __future__ import annotations

import pytest

from tokenbudget.core import ModelRunnerOutput
from tokenbudget.core.failures import RequestFailure, WorkerReplyError


def _reply(so, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        ids, {r: i for i, r in enumerate(ids)}, [sampled.get(r, []) for r in ids]
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_reply_missing_a_sampled_token_is_a_step_error(
    make_scheduler, make_request, async_scheduling
):
    s = make_scheduler(async_scheduling=async_scheduling)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    so = s.schedule()
    # Async scheduling lists them (later steps change the counts); sync reads the counts.
    assert so.must_sample == ({"a", "b"} if async_scheduling else set())
    with pytest.raises(WorkerReplyError, match="no token for request 'b', which had to sample"):
        s.update_from_output(so, _reply(so, {"a": [5]}))


def test_a_draft_step_reply_missing_its_token_is_a_step_error(
    make_scheduler, make_request, step, fake_model
):
    s = make_scheduler(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    s.add_request(make_request("a", 8))
    step(s, fake_model(drafts=lambda r: [1, 2]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    with pytest.raises(WorkerReplyError, match="'a'"):
        s.update_from_output(so, _reply(so, {}))
    # A reply row short of the scheduled requests is the same error, not an IndexError.
    with pytest.raises(WorkerReplyError):
        s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, []))


def test_mid_prefill_requests_and_reported_failures_need_no_token(make_scheduler, make_request):
    s = make_scheduler(max_num_batched_tokens=40)
    s.add_request(make_request("long", 60))
    s.add_request(make_request("bad", 4))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 40}
    s.update_from_output(so, _reply(so, {}))  # mid-prefill: no token is right
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 20, "bad": 4}
    reply = _reply(so, {"long": [7]})
    reply.failed = {"bad": RequestFailure("ValueError: its bias", invalid_argument=True)}
    outs = s.update_from_output(so, reply)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error"), ("long", None)]
    assert "bad" not in s.requests and s.requests["long"].output_token_ids == [7]
    s.kv_cache_manager.block_pool.check_invariants()
