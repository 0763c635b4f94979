"""policy="slo" (deadline order, early refusal) and fair_share (weighted fair
queueing over tenants) in the real scheduler, with the fake model."""
from __future__ import annotations

import pytest

from tokenbudget.core import Request, SamplingParams, SchedulerConfig


def _admitted_order(sched, step, n):
    order = []
    for _ in range(200):
        so, _ = step(sched)
        order += [r.req_id for r in so.scheduled_new_reqs]
        if len(order) == n:
            return order
    raise AssertionError(order)


def test_slo_admits_the_earliest_ttft_deadline_first(make_scheduler, make_request, step):
    sched = make_scheduler(policy="slo", max_num_seqs=1, slo_step_time_ms=1.0)
    sched.clock = lambda: 10.0
    for rid, arrival, ttft in (("lax", 9.0, 5000.0), ("none", 9.1, None), ("tight", 9.5, 800.0)):
        req = make_request(rid, 8, max_tokens=1, arrival=arrival)
        req.ttft_ms = ttft
        sched.add_request(req)
    # Deadlines: tight 10.3, lax 14.0, none never (after every target).
    assert _admitted_order(sched, step, 3) == ["tight", "lax", "none"]


def test_slo_refuses_early_what_cannot_meet_its_ttft(make_scheduler, make_request, step):
    sched = make_scheduler(policy="slo", slo_reject_late=True, slo_step_time_ms=50.0,
                           max_num_batched_tokens=64)
    sched.clock = lambda: 0.0
    ok = make_request("ok", 32, max_tokens=2, arrival=0.0)
    ok.ttft_ms = 100.0  # one 50 ms step: in time
    late = make_request("late", 256, max_tokens=2, arrival=0.0)
    late.ttft_ms = 100.0  # four steps of 64 tokens: 200 ms
    sched.add_request(ok)
    sched.add_request(late)
    so, outs = step(sched)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["ok"]
    refused = [o for o in outs if o.request_id == "late"]
    assert refused and refused[0].finish_reason == "abort"
    assert refused[0].stop_reason == "cannot meet its TTFT target"
    assert "late" not in sched.requests
    sched.kv_cache_manager.block_pool.check_invariants()


def test_slo_keeps_late_requests_queued_when_not_rejecting(make_scheduler, make_request,
                                                           run_to_completion):
    sched = make_scheduler(policy="slo", slo_step_time_ms=50.0, max_num_batched_tokens=64)
    sched.clock = lambda: 0.0
    late = make_request("late", 256, max_tokens=2, arrival=0.0)
    late.ttft_ms = 100.0
    sched.add_request(late)
    run = run_to_completion(sched)
    assert run.finish_reasons == {"late": "length"}


def test_fair_share_interleaves_tenants_by_weighted_tokens(make_scheduler, make_request, step):
    sched = make_scheduler(fair_share=True, max_num_seqs=1, tenant_weights={"b": 2.0})
    for i in range(6):
        req = make_request(f"a{i}", 16, max_tokens=1)
        req.tenant = "a"
        sched.add_request(req)
    for i in range(4):
        req = make_request(f"b{i}", 16, max_tokens=1)
        req.tenant = "b"
        sched.add_request(req)
    # b weighs twice a: two of b's requests per one of a's once both wait.
    assert _admitted_order(sched, step, 10) == ["a0", "b0", "b1", "a1", "b2", "b3", "a2",
                                                "a3", "a4", "a5"]


def test_fair_share_takes_a_seat_back_from_the_tenant_above_its_share(
        make_scheduler, make_request, step, run_to_completion):
    sched = make_scheduler(fair_share=True, max_num_seqs=4)
    for i in range(4):
        req = make_request(f"a{i}", 16, max_tokens=50)
        req.tenant = "a"
        sched.add_request(req)
    step(sched)
    assert len(sched.running) == 4
    b = make_request("b0", 16, max_tokens=5)
    b.tenant = "b"
    sched.add_request(b)
    so, _ = step(sched)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b0"]
    assert so.preempted_req_ids == {"a3"}  # a's latest admitted gives its seat back
    run = run_to_completion(sched)
    assert len(run.finish_reasons) == 5


def test_slo_and_fair_share_options_are_validated():
    with pytest.raises(ValueError, match="fair_share"):
        SchedulerConfig(policy="priority", fair_share=True)
    with pytest.raises(ValueError, match="tenant_weights"):
        SchedulerConfig(fair_share=True, tenant_weights={"a": 0})
    with pytest.raises(ValueError, match="ttft_ms must be > 0"):
        Request("r", [1, 2], SamplingParams(), ttft_ms=0)
    r = Request("r", [1, 2], SamplingParams(), tenant="t", ttft_ms=200, tpot_ms=20)
    assert (r.tenant, r.ttft_ms, r.tpot_ms) == ("t", 200, 20)


def test_slo_step_time_ignores_idle_gaps(make_scheduler, make_request, run_to_completion):
    # The first request runs 10 ms steps; the second arrives after a minute of
    # idling. Learning that gap as a step would refuse it (one step > 500 ms).
    now = [0.0]
    sched = make_scheduler(policy="slo", slo_reject_late=True)
    sched.clock = lambda: now[0]
    model_calls = []

    def tick(s):
        model_calls.append(1)
        now[0] += 0.01

    first = make_request("first", 16, max_tokens=4, arrival=0.0)
    first.ttft_ms = 500.0
    sched.add_request(first)
    run_to_completion(sched, check=tick)
    now[0] += 60.0
    second = make_request("second", 16, max_tokens=4, arrival=now[0])
    second.ttft_ms = 500.0
    sched.add_request(second)
    run = run_to_completion(sched, check=tick)
    assert run.finish_reasons == {"second": "length"}
    assert sched._slo.step_s == pytest.approx(0.01)
