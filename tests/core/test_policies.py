"""SGLang-style policies inside the token-budget scheduler (issue 6)."""

from __future__ import annotations

import pytest

from tokenbudget.core import RequestStatus, SchedulerConfig
from tokenbudget.core.policy.cache_aware import make_victim_picker
from tokenbudget.core.failures import QueueFullError

BASE = list(range(100, 164))  # a 64-token (4-block) prefix
OTHER = list(range(500, 548))  # a 48-token (3-block) prefix


def tail(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def warm(sched, step, make_request, rid: str, prompt: list[int]) -> None:
    """Run one request to completion so its full blocks stay cached."""
    sched.add_request(make_request(rid, prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)


@pytest.fixture
def make_scheduler(make_scheduler):
    """Test requests arrive at t = 1, 2, ...; a clock stopped at 0 keeps them
    clear of aging unless a test sets its own clock."""

    def make(**kwargs):
        sched = make_scheduler(**kwargs)
        sched.clock = lambda: 0.0
        return sched

    return make


def order(sched) -> tuple[list[str], set[str]]:
    dep = sched._order.reorder(sched.waiting, sched.kv_cache_manager, sched.clock())
    return [r.request_id for r in sched.waiting], dep


# -- orderings -------------------------------------------------------------
def test_lpm_orders_by_cached_prefix_then_arrival(make_scheduler, make_request, step):
    sched = make_scheduler(policy="lpm")
    warm(sched, step, make_request, "warm", BASE)
    for rid, prompt in [
        ("cold", tail(40, 900)),
        ("b16", BASE[:16] + tail(20, 700)),
        ("c48", BASE[:48] + tail(10, 720)),
        ("d64", BASE + tail(10, 740)),
        ("e32", BASE[:32] + tail(5, 760)),
        ("d64b", BASE + tail(3, 780)),
    ]:
        sched.add_request(make_request(rid, prompt))
    ids, dep = order(sched)
    assert ids == ["d64", "d64b", "c48", "e32", "b16", "cold"]
    assert dep == set()


def test_lpm_falls_back_to_fcfs_above_the_queue_bound(make_scheduler, make_request, step):
    sched = make_scheduler(policy="lpm", lpm_fallback_queue_len=3)
    warm(sched, step, make_request, "warm", BASE)
    for rid, prompt in [
        ("cold", tail(40, 900)),
        ("b16", BASE[:16] + tail(20, 700)),
        ("d64", BASE + tail(10, 740)),
        ("c48", BASE[:48] + tail(10, 720)),
    ]:
        sched.add_request(make_request(rid, prompt))
    assert order(sched)[0] == ["cold", "b16", "d64", "c48"]


def test_dfs_weight_groups_requests_by_cached_branch_heaviest_first(
    make_scheduler, make_request, step
):
    sched = make_scheduler(policy="dfs-weight")
    warm(sched, step, make_request, "warm1", BASE)
    warm(sched, step, make_request, "warm2", OTHER)
    arrivals = [
        ("y1", OTHER + tail(5, 800)),
        ("d1", BASE + tail(5, 810)),
        ("a", tail(40, 900)),
        ("y2", OTHER + tail(6, 820)),
        ("c", BASE[:48] + tail(9, 830)),
        ("b", BASE[:16] + tail(30, 840)),
        ("d2", BASE + tail(7, 850)),
        ("y3", OTHER + tail(8, 860)),
    ]
    for rid, prompt in arrivals:
        sched.add_request(make_request(rid, prompt))
    ids, _ = order(sched)
    # The BASE branch (weight 4) before OTHER (3), deepest node first within
    # a branch; cold requests (at the root) last; arrival order at one node.
    assert ids == ["d1", "d2", "c", "b", "y1", "y2", "y3", "a"]


def test_lof_orders_by_longest_remaining_output(make_scheduler, make_request):
    sched = make_scheduler(policy="lof")
    for rid, mt in [("s", 4), ("l", 64), ("m", 16), ("l2", 64)]:
        sched.add_request(make_request(rid, 8, max_tokens=mt))
    assert order(sched)[0] == ["l", "l2", "m", "s"]


def test_random_is_a_seeded_permutation(make_scheduler, make_request):
    def ids_for(seed: int) -> list[str]:
        sched = make_scheduler(policy="random", random_seed=seed)
        for i in range(12):
            sched.add_request(make_request(f"r{i}", 8, arrival=float(i)))
        return order(sched)[0]

    first = ids_for(1)
    assert sorted(first) == sorted(f"r{i}" for i in range(12))
    assert ids_for(1) == first
    assert ids_for(2) != first
    assert first != [f"r{i}" for i in range(12)]


def test_priority_flag_runs_higher_values_first(make_scheduler, make_request):
    sched = make_scheduler(policy="priority", priority_descending=True)
    for rid, p in [("low", 1), ("high", 9), ("mid", 5)]:
        sched.add_request(make_request(rid, 8, priority=p))
    assert [r.request_id for r in sched.waiting] == ["high", "mid", "low"]


# -- in-batch prefix deprioritisation ---------------------------------------
def _shared_group(make_request):
    shared = tail(64, 300)
    return [
        make_request(rid, shared + tail(16, 400 + 20 * k), max_tokens=4)
        for k, rid in enumerate(["A", "B", "C"])
    ]


def test_in_batch_sharers_wait_one_round_then_hit(make_scheduler, make_request, step):
    sched = make_scheduler(policy="lpm")
    for r in _shared_group(make_request):
        sched.add_request(r)
    so1, _ = step(sched)
    assert so1.num_scheduled_tokens == {"A": 80}
    so2, _ = step(sched)
    assert {r: so2.num_scheduled_tokens[r] for r in ("B", "C")} == {"B": 16, "C": 16}
    assert [sched.requests[r].num_cached_tokens for r in ("B", "C")] == [64, 64]
    # The shared prefix was computed once: 80 + 16 + 16 prompt tokens in all.
    prompt_tokens = so1.num_scheduled_tokens["A"] + 16 + 16
    assert prompt_tokens == 112


def test_without_deprioritisation_same_step_admission_still_shares(
    make_scheduler, make_request, step
):
    # Blocks are registered when allocated, so requests admitted later in the
    # same step hit what the earlier one computes in that very forward.
    sched = make_scheduler(policy="lpm", in_batch_prefix_check_threshold=0)
    for r in _shared_group(make_request):
        sched.add_request(r)
    so1, _ = step(sched)
    assert so1.num_scheduled_tokens == {"A": 80, "B": 16, "C": 16}


# -- aging -------------------------------------------------------------------
def _first_step_of_cold_request(make_scheduler, make_request, step, aging: float) -> int | None:
    now = [0.0]
    sched = make_scheduler(
        policy="lpm",
        aging_bound_s=aging,
        max_num_batched_tokens=20,
        in_batch_prefix_check_threshold=0,
    )
    sched.clock = lambda: now[0]
    warm(sched, step, make_request, "warm", BASE)
    sched.add_request(make_request("cold", tail(40, 900), max_tokens=1, arrival=0.0))
    for n in range(30):
        # A steady stream of cache-hot requests: two per step.
        for k in range(2):
            sched.add_request(
                make_request(
                    f"hot{n}-{k}",
                    BASE + tail(16, 1000 + 40 * n + 20 * k),
                    max_tokens=1,
                    arrival=now[0],
                )
            )
        so, _ = step(sched)
        if "cold" in so.num_scheduled_tokens:
            return n
        now[0] += 1.0
    return None


def test_aging_bounds_the_wait_of_a_cold_request(make_scheduler, make_request, step):
    first = _first_step_of_cold_request(make_scheduler, make_request, step, aging=5.0)
    # One step per simulated second: served within the bound plus one step.
    assert first is not None and first <= 5 + 1
    # Without aging the same stream starves it.
    assert _first_step_of_cold_request(make_scheduler, make_request, step, aging=0.0) is None


# -- admission reserve ---------------------------------------------------------
def _reserve_run(make_scheduler, make_request, run_to_completion, reserve: bool):
    sched = make_scheduler(
        policy="fcfs", admission_reserve=reserve, num_blocks=301, max_num_batched_tokens=4096
    )
    for i in range(64):
        sched.add_request(make_request(f"r{i}", 64, max_tokens=64 + 4 * (i % 17)))
    run = run_to_completion(sched)
    tokens = sum(len(t) for t in run.tokens.values())
    computed = sum(sum(s.values()) for s in run.schedules)
    # Simulated time: a fixed cost per step plus compute per token (recomputing
    # a preempted request is not free).
    sim_time = len(run.schedules) + computed / 512
    return sched.num_preemptions, len(run.schedules), sim_time, tokens


def test_admission_reserve_cuts_preemptions_at_similar_throughput(
    make_scheduler, make_request, run_to_completion
):
    pre_off, steps_off, time_off, tokens_off = _reserve_run(
        make_scheduler, make_request, run_to_completion, False
    )
    pre_on, steps_on, time_on, tokens_on = _reserve_run(
        make_scheduler, make_request, run_to_completion, True
    )
    assert tokens_on == tokens_off
    assert pre_off >= 20
    assert pre_on <= pre_off // 10
    # Throughput of the simulated run within 10%, in steps and in simulated time.
    assert steps_on <= 1.1 * steps_off
    assert time_on <= 1.1 * time_off


def _admits_into_blocks_the_running_request_will_need(
    make_scheduler, make_request, step, **config
) -> bool:
    """One running request will grow by 40 tokens (10 blocks) into 14 free
    blocks; a newcomer needs 8 of them now. Without a reserve it is admitted."""
    sched = make_scheduler(block_size=4, num_blocks=17, **config)
    sched.add_request(make_request("running", 8, max_tokens=40, ignore_eos=True))
    step(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 14
    sched.add_request(make_request("new", 30, max_tokens=2))
    so, _ = step(sched)
    return "new" in so.num_scheduled_tokens


def test_reserve_is_off_by_default_for_fcfs_and_on_for_cache_aware_policies(
    make_scheduler, make_request, step
):
    def admits(**config):
        return _admits_into_blocks_the_running_request_will_need(
            make_scheduler, make_request, step, **config
        )

    assert admits(policy="fcfs") and admits(policy="priority")  # vLLM: no reserve
    assert not admits(policy="lpm") and not admits(policy="lof")
    assert not admits(policy="fcfs", admission_reserve=True)
    assert admits(policy="lpm", admission_reserve=False)


# -- victims ------------------------------------------------------------------
def _first_victim(make_scheduler, make_request, step, preemption_mode: str) -> set[str]:
    """``a`` decodes alone for a while; then ``long`` (12-token prompt) and
    ``short`` (4) are admitted in that order and generate in lockstep until
    the 10 usable blocks run out."""
    sched = make_scheduler(block_size=4, num_blocks=11, preemption_mode=preemption_mode)
    sched.add_request(make_request("a", 4, max_tokens=60, ignore_eos=True))
    for _ in range(4):
        step(sched)
    sched.add_request(make_request("long", 12, max_tokens=60, ignore_eos=True))
    sched.add_request(make_request("short", 4, max_tokens=60, ignore_eos=True))
    for _ in range(60):
        so, _ = step(sched)
        if so.preempted_req_ids:
            return so.preempted_req_ids
    raise AssertionError("memory never ran out")


def test_retract_preempts_fewest_generated_then_longest_prompt_in_the_scheduler(
    make_scheduler, make_request, step
):
    # long and short have generated as many tokens (fewer than a): the longer prompt goes.
    assert _first_victim(make_scheduler, make_request, step, "retract") == {"long"}
    # vLLM's order: the last admitted.
    assert _first_victim(make_scheduler, make_request, step, "vllm") == {"short"}


def test_retract_order_takes_fewest_generated_then_longest_prompt(make_request):
    pick = make_victim_picker(SchedulerConfig(preemption_mode="retract"))
    a = make_request("a", 32)
    b = make_request("b", 32)
    c = make_request("c", 64)
    a.append_output_token_ids([1] * 10)
    b.append_output_token_ids([1] * 2)
    c.append_output_token_ids([1] * 2)
    assert pick([a, b, c]) is c
    assert pick([c, b, a]) is c
    assert make_victim_picker(SchedulerConfig())([a, b, c]) is c  # vLLM: last admitted
    assert make_victim_picker(SchedulerConfig())([c, a, b]) is b


# -- priority preemption on admission ---------------------------------------------
def _full_memory_then_urgent(make_scheduler, make_request, step, running_priority: int):
    # 3 running requests of 60 tokens fill 12 blocks (4 each, room to decode).
    sched = make_scheduler(policy="priority", num_blocks=13)
    for i in range(3):
        sched.add_request(make_request(f"bg{i}", 60, priority=running_priority, max_tokens=4))
    step(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    sched.add_request(make_request("urgent", 30, priority=0, max_tokens=2))
    so, _ = step(sched)
    return sched, so


def test_high_priority_request_displaces_much_worse_running_ones(
    make_scheduler, make_request, step, run_to_completion
):
    sched, so = _full_memory_then_urgent(make_scheduler, make_request, step, 20)
    assert so.num_scheduled_tokens.get("urgent") == 30
    assert so.preempted_req_ids == {"bg2"}  # only as many as needed: the latest arrival
    assert sched.requests["bg2"].status == RequestStatus.PREEMPTED
    run = run_to_completion(sched)
    assert set(run.finish_reasons) == {"urgent", "bg0", "bg1", "bg2"}


def test_priority_gap_below_threshold_does_not_preempt(make_scheduler, make_request, step):
    sched, so = _full_memory_then_urgent(make_scheduler, make_request, step, 5)
    assert "urgent" not in so.num_scheduled_tokens
    assert so.preempted_req_ids == set()


# -- queue limit -------------------------------------------------------------------
def test_queue_limit_rejects_the_next_request(make_scheduler, make_request):
    sched = make_scheduler(max_queued_requests=2)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    with pytest.raises(QueueFullError, match="max_queued_requests=2"):
        sched.add_request(make_request("c", 8))
    assert "c" not in sched.requests


def test_queue_limit_with_priority_evicts_the_worst_for_a_better_newcomer(
    make_scheduler, make_request, step
):
    sched = make_scheduler(policy="priority", max_queued_requests=2)
    sched.add_request(make_request("p5", 8, priority=5))
    sched.add_request(make_request("p7", 8, priority=7))
    sched.add_request(make_request("p1", 8, priority=1))
    assert sorted(r.request_id for r in sched.waiting) == ["p1", "p5"]
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("p9", 8, priority=9))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("p5b", 8, priority=5))
    _, outs = step(sched)
    evicted = [o for o in outs if o.request_id == "p7"]
    assert evicted and evicted[0].finish_reason == "abort"
    sched.kv_cache_manager.block_pool.check_invariants()


def test_eviction_notice_is_returned_by_the_next_engine_step(make_request):
    from concurrent.futures import Future

    from tokenbudget.core import CacheConfig, ModelRunnerOutput
    from tokenbudget.server.engine.core import EngineCore

    class IdleExecutor:
        def initialize(self, cache_config, scheduler_config):
            return 64

        def execute_model(self, so):
            # One token for each request that completed its prompt (a reply
            # without it is an error); the scheduler already counted the step.
            ids = [
                r
                for r, n in so.num_scheduled_tokens.items()
                if engine.scheduler.requests[r].num_computed_tokens
                >= engine.scheduler.requests[r].num_tokens
            ]
            fut = Future()
            fut.set_result(
                ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[5] for _ in ids])
            )
            return fut

        def shutdown(self):
            pass

    # max_num_seqs=1 with a long-running request: the queue fills, nothing new runs.
    engine = EngineCore(
        SchedulerConfig(policy="priority", max_queued_requests=1, max_num_seqs=1),
        CacheConfig(),
        IdleExecutor(),
    )
    engine.add_request(make_request("p5", 8, priority=5))
    engine.add_request(make_request("p1", 8, priority=1))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("p5", "abort")]


def test_dfs_weight_orders_only_the_head_window(make_scheduler, make_request, step):
    sched = make_scheduler(policy="dfs-weight", cache_aware_window=2)
    warm(sched, step, make_request, "warm", BASE)
    for rid, prompt in [
        ("cold1", tail(40, 900)),
        ("hot1", BASE + tail(5, 700)),
        ("cold2", tail(40, 950)),
        ("hot2", BASE + tail(5, 720)),
    ]:
        sched.add_request(make_request(rid, prompt))
    ids, _ = order(sched)
    # The window [cold1, hot1] is ordered (cached first); cold2 and hot2 keep
    # their FCFS places behind it.
    assert ids == ["hot1", "cold1", "cold2", "hot2"]
