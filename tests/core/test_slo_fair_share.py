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
    sched = make_scheduler(
        policy="slo", slo_reject_late=True, slo_step_time_ms=50.0, max_num_batched_tokens=64
    )
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


def test_slo_keeps_late_requests_queued_when_not_rejecting(
    make_scheduler, make_request, run_to_completion
):
    sched = make_scheduler(policy="slo", slo_step_time_ms=50.0, max_num_batched_tokens=64)
    sched.clock = lambda: 0.0
    late = make_request("late", 256, max_tokens=2, arrival=0.0)
    late.ttft_ms = 100.0
    sched.add_request(late)
    run = run_to_completion(sched)
    assert run.finish_reasons == {"late": "length"}


@pytest.mark.parametrize("reject_late", [True, False])
def test_slo_resumes_a_preempted_request_with_output_first_and_never_refuses_it(
    make_scheduler, make_request, step, reject_late
):
    # Two 16-token prompts growing to 56 tokens in 6 blocks of 16: the later
    # one is preempted with output. It met its TTFT already, so it must come
    # back ahead of the request still waiting for its first token (not be
    # refused as late mid-generation, nor wait behind on-time requests). When
    # the first finishes, the victim and the newcomer do not both fit.
    sched = make_scheduler(
        policy="slo",
        slo_reject_late=reject_late,
        slo_step_time_ms=1.0,
        num_blocks=7,
        max_num_seqs=2,
    )
    sched.clock = lambda: 0.0
    for rid, arrival in (("a", 0.0), ("b", 0.0)):
        req = make_request(rid, 16, max_tokens=40, arrival=arrival)
        req.ttft_ms = 1000.0
        sched.add_request(req)
    finish, admitted_at, preempted = {}, {}, set()
    for n in range(500):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched)
        preempted |= so.preempted_req_ids
        for rid in [r.req_id for r in so.scheduled_new_reqs] + list(
            so.scheduled_cached_reqs.resumed_token_ids
        ):
            admitted_at.setdefault(rid, []).append(n)
        finish.update((o.request_id, o.finish_reason) for o in outs if o.finish_reason)
        if preempted and "c" not in sched.requests and "c" not in finish:
            # A newcomer with time to spare arrives while the victim waits.
            c = make_request("c", 48, max_tokens=4, arrival=0.0)
            c.ttft_ms = 1000.0
            sched.add_request(c)
    assert preempted == {"b"}
    assert finish == {"a": "length", "b": "length", "c": "length"}
    assert admitted_at["b"][1] < admitted_at["c"][0], admitted_at
    sched.kv_cache_manager.block_pool.check_invariants()


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
    assert _admitted_order(sched, step, 10) == [
        "a0",
        "b0",
        "b1",
        "a1",
        "b2",
        "b3",
        "a2",
        "a3",
        "a4",
        "a5",
    ]


def test_fair_share_takes_a_seat_back_from_the_tenant_above_its_share(
    make_scheduler, make_request, step, run_to_completion
):
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


@pytest.mark.parametrize("cap", [True, False])
def test_fair_share_caps_a_tenants_prompt_tokens_per_step_at_its_share(
    make_scheduler, make_request, run_to_completion, cap
):
    # Budget 256 and b weighs 3: while b has work, a's prompt tokens per step
    # are capped at 256 * 1 / (1 + 3) = 64, first chunk (admission) included.
    sched = make_scheduler(
        fair_share=True,
        fair_share_chunk_cap=cap,
        tenant_weights={"b": 3.0},
        max_num_batched_tokens=256,
    )
    for i in range(3):
        b = make_request(f"b{i}", 8, max_tokens=30)
        b.tenant = "b"
        sched.add_request(b)
    a = make_request("a", 3000, max_tokens=2)
    a.tenant = "a"
    sched.add_request(a)
    run = run_to_completion(sched)
    with_b = [s["a"] for s in run.schedules if "a" in s and any(r.startswith("b") for r in s)]
    alone = [s["a"] for s in run.schedules if "a" in s and not any(r.startswith("b") for r in s)]
    # b's decodes are never held back: one token a step from admission to the end.
    assert sum(1 for s in run.schedules if "b0" in s) == 30
    assert len(run.finish_reasons) == 4
    if cap:
        assert with_b == [64] * 30  # b's 30 steps
        assert max(alone) == 256  # alone, a gets the whole budget again
    else:
        assert max(with_b) > 64


def test_fair_share_chunk_cap_needs_two_tenants_with_work(make_scheduler, make_request, step):
    sched = make_scheduler(fair_share=True, max_num_batched_tokens=256)
    for i in range(2):
        r = make_request(f"a{i}", 400, max_tokens=2)
        r.tenant = "a"
        sched.add_request(r)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a0": 256}  # one tenant: no share to keep
    b = make_request("b0", 400, max_tokens=2)
    b.tenant = "b"
    sched.add_request(b)
    so, _ = step(sched)
    # Equal weights: a's running prompt gets its half; b's first chunk the other.
    assert so.num_scheduled_tokens == {"a0": 128, "b0": 128}


def test_slo_chunk_order_decodes_then_least_slack_then_late(make_scheduler, make_request, step):
    # 100 ms steps, 64-token chunks: slack = deadline - now - chunks left x 0.1 s.
    sched = make_scheduler(policy="slo", slo_step_time_ms=100.0, max_num_batched_tokens=64)
    sched.clock = lambda: 10.0
    specs = {
        "loose": (640, 5000.0),
        "none": (640, None),
        "tight": (128, 500.0),
        "late": (640, 200.0),
        "decode": (4, None),
    }
    reqs = {}
    for rid, (n, ttft) in specs.items():
        reqs[rid] = req = make_request(rid, n, max_tokens=8, arrival=10.0)
        req.ttft_ms = ttft
    resumed = make_request("resumed", 640, max_tokens=8, arrival=10.0)
    resumed.output_token_ids.append(1)  # has output: its next token is due now
    running = [reqs["loose"], reqs["none"], reqs["late"], resumed, reqs["tight"], reqs["decode"]]
    reqs["decode"].num_computed_tokens = 3
    order = sched._slo.chunk_order(running, 10.0)
    # tight: 10.5 - 10 - 2 x 0.1 = 0.3 s; loose: 5 - 1 = 4 s; late: 0.2 - 1 < 0 (last,
    # with "none", in running order).
    assert [r.request_id for r in order] == ["decode", "resumed", "tight", "loose", "none", "late"]
    assert sched._slo.chunk_order([reqs["decode"]], 10.0) == [reqs["decode"]]


def test_fair_share_forgets_idle_tenants_it_owes_nothing(make_scheduler, make_request, step):
    """A stream of distinct tenants, one after another, while tenant "a" keeps
    decoding: the tenants that left are forgotten once "a" has caught up with
    them (they would start at its virtual time anyway), so the table holds
    the busy tenants and a few recent ones, not every tenant ever seen."""
    sched = make_scheduler(fair_share=True, max_num_seqs=4)
    fair = sched.policy.parts["fair_share"]
    long = make_request("a0", 8, max_tokens=5000)
    long.tenant = "a"
    sched.add_request(long)
    step(sched)
    for i in range(300):
        req = make_request(f"t{i}", 2, max_tokens=1)
        req.tenant = f"tenant-{i}"
        sched.add_request(req)
        for _ in range(4):
            step(sched)
        assert f"t{i}" not in sched.requests
    assert "a" in fair.vtime
    assert len(fair.vtime) < 10, sorted(fair.vtime)
