"""The host KV tier at the scheduler: swap on preemption, spill and load of
prefix blocks, and KV cache events, checked against a KV oracle.

The oracle (KVOracle in conftest.py) stands in for the worker's KV cache and
fails on any read of KV that is not the request's own.
"""

from __future__ import annotations

import random

import pytest

from tokenbudget.core import (
    CacheConfig,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.core.kv.events import DEVICE, HOST, AllCleared, KVEventGap, KVEventReplayer

from .conftest import KVOracle

EOS = 0


def sample(s: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
    """One token per request whose prompt is computed: a function of its history."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = s.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([1 + hash(tuple(req.all_token_ids)) % 11] if done else [])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def make_scheduler(
    num_blocks: int,
    num_offload_blocks: int | None,
    *,
    block_size: int = 4,
    caching: bool = True,
    events: bool = False,
    policy: str = "fcfs",
    load_budget: int = 256,
    budget: int = 64,
    max_seqs: int = 8,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=128, policy=policy
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=caching,
            num_offload_blocks=num_offload_blocks,
            kv_load_blocks_per_step=load_budget,
            enable_kv_cache_events=events,
        ),
    )


PREFIXES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]


def random_request(rng: random.Random, rid: str, priority: bool = False) -> Request:
    prefix = rng.choice(PREFIXES + [[]])[: rng.randint(0, 16)]
    prompt = prefix + [rng.randint(1, 11) for _ in range(rng.randint(1, 16))]
    params = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True)
    return Request(
        rid,
        prompt,
        params,
        eos_token_id=EOS,
        priority=rng.randint(0, 2) if priority else 0,
        arrival_time=float(rid[1:]),
    )


def check_tiers(s: Scheduler) -> None:
    s.kv_cache_manager.block_pool.check_invariants()
    s.kv_tiering.check_invariants()
    waiting = {r.request_id for r in s.waiting}
    assert set(s.kv_tiering.swapped) <= waiting, "a swapped request is not waiting"


def run_workload(
    s: Scheduler, rng: random.Random, num_ops: int, *, priority: bool = False, on_step=None
) -> tuple[dict[str, list[int]], KVOracle]:
    oracle = KVOracle(s.cache_config.block_size)
    outputs: dict[str, list[int]] = {}
    n = 0

    def step() -> None:
        so = s.schedule()
        oracle.step(s, so)
        if not so.is_empty:
            for out in s.update_from_output(so, sample(s, so)):
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_tiers(s)
        if on_step is not None:
            on_step(s)

    for _ in range(num_ops):
        op = rng.random()
        if op < 0.3:
            s.add_request(random_request(rng, f"r{n}", priority))
            n += 1
        elif op < 0.36 and s.requests:
            s.finish_requests(rng.choice(sorted(s.requests)), RequestStatus.FINISHED_ABORTED)
            check_tiers(s)
        else:
            step()
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests()
    return outputs, oracle


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_read_only_their_own_kv_and_leak_no_block_in_either_tier(seed):
    rng = random.Random(seed)
    host = rng.choice([None, 2, 6, 40])
    block_size = rng.choice([2, 4])
    # Room for one request at its longest (48 tokens), and little more: preemptions.
    s = make_scheduler(
        num_blocks=48 // block_size + 1 + rng.randint(0, 6),
        num_offload_blocks=host,
        block_size=block_size,
        caching=rng.random() < 0.8,
        policy=rng.choice(["fcfs", "priority"]),
        load_budget=rng.choice([1, 3, 256]),
        budget=rng.choice([8, 32, 64]),
    )
    _, oracle = run_workload(s, rng, 120, priority=s.scheduler_config.policy == "priority")
    assert oracle.num_reads > 0
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == s.cache_config.num_blocks - 1
    t = s.kv_tiering
    assert not t.swapped
    if t.host is not None:
        assert t.host.get_num_free_blocks() == t.host.num_usable
        assert all(slot.ref_cnt == 0 for slot in t.host.blocks)


def _pressure(num_offload_blocks: int | None, caching: bool = True):
    rng = random.Random(7)
    s = make_scheduler(
        num_blocks=17, num_offload_blocks=num_offload_blocks, caching=caching, budget=64, max_seqs=8
    )
    for i in range(8):
        prompt = [rng.randint(1, 11) for _ in range(12)]
        s.add_request(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=24, ignore_eos=True),
                eos_token_id=EOS,
                arrival_time=float(i),
            )
        )
    outputs, oracle = run_workload(s, rng, 0)
    return outputs, s


@pytest.mark.parametrize("caching", [True, False])
def test_with_room_in_the_host_tier_preemption_recomputes_nothing(caching):
    reference, big = _pressure(None)
    assert big.make_stats().num_preemptions > 0
    swapped, s = _pressure(200, caching)
    stats = s.make_stats()
    assert stats.num_preemptions > 0
    assert stats.num_recomputed_tokens == 0
    assert stats.kv_swap_out_blocks > 0 and stats.kv_swap_in_blocks > 0
    assert swapped == reference
    # Without a host tier the same workload recomputes what preemption dropped.
    recomputed, s0 = _pressure(None, caching)
    assert recomputed == reference
    assert s0.make_stats().num_recomputed_tokens > 0


def test_a_host_tier_too_small_falls_back_to_recompute():
    reference, _ = _pressure(None)
    small, s = _pressure(2)
    stats = s.make_stats()
    assert small == reference
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0


@pytest.mark.parametrize("num_offload_blocks", [None, 8])
def test_a_victim_already_scheduled_this_step_leaves_no_uncomputed_block_cached(num_offload_blocks):
    """A's chunk (positions 6-8) completes a block, hashed when scheduled, and
    starts another; later in the same step B needs a block and A, the worse
    priority, is preempted. The completed block's KV is never computed, so it
    must not stay findable: A, resumed next step, would hit it."""
    s = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64,
            max_model_len=64,
            policy="priority",
            long_prefill_token_threshold=3,
        ),
        CacheConfig(block_size=4, num_blocks=5, num_offload_blocks=num_offload_blocks),
    )
    oracle = KVOracle(4)

    def step() -> SchedulerOutput:
        so = s.schedule()
        oracle.step(s, so)
        if not so.is_empty:
            s.update_from_output(so, sample(s, so))
        check_tiers(s)
        return so

    s.add_request(
        Request(
            "a",
            list(range(1, 15)),
            SamplingParams(max_tokens=2, ignore_eos=True),
            eos_token_id=EOS,
            priority=1,
            arrival_time=0.0,
        )
    )
    step()
    s.add_request(
        Request(
            "b",
            list(range(20, 26)),
            SamplingParams(max_tokens=2, ignore_eos=True),
            eos_token_id=EOS,
            priority=0,
            arrival_time=1.0,
        )
    )
    step()
    assert step().preempted_req_ids == {"a"}
    while s.has_unfinished_requests():
        step()
    assert oracle.num_reads > 0


def test_an_evicted_prefix_is_loaded_back_from_the_host_tier():
    s = make_scheduler(num_blocks=9, num_offload_blocks=16, block_size=4)
    oracle = KVOracle(4)

    def run(rid: str, prompt: list[int]) -> Request:
        req = Request(
            rid,
            prompt,
            SamplingParams(max_tokens=1, ignore_eos=True),
            eos_token_id=EOS,
            arrival_time=0.0,
        )
        s.add_request(req)
        while s.has_unfinished_requests():
            so = s.schedule()
            oracle.step(s, so)
            s.update_from_output(so, sample(s, so))
        check_tiers(s)
        return req

    first = list(range(1, 25))  # 6 full blocks
    a = run("a", first)
    run("b", [50 + i for i in range(28)])  # 7 of the 8 blocks: evicts a's last 5
    device, host = s.kv_cache_manager.block_pool.cached, s.kv_tiering.host.cached
    assert [h in device for h in a.block_hashes] == [True] + [False] * 5
    assert all(h in host for h in a.block_hashes[1:]), "evicted blocks spill to the host"
    a2 = run("a2", first + [99])
    assert a2.num_cached_tokens == 24, "1 block from the device, 5 from the host"
    assert s.make_stats().kv_swap_in_blocks == 5
    assert s.kv_tiering.num_host_hit_tokens == 20
    assert oracle.num_reads >= 24  # a2's first token read all 24 positions, checked


def test_replaying_kv_events_rebuilds_each_tiers_cached_hashes():
    rng = random.Random(3)
    s = make_scheduler(num_blocks=27, num_offload_blocks=10, events=True, block_size=2)
    sub = s.kv_tiering.events.subscribe(max_pending=10_000)
    replayer = KVEventReplayer()
    kinds = set()

    def compare(s: Scheduler) -> None:
        while (batch := sub.get(timeout=0)) is not None:
            replayer.apply(batch)
            kinds.update((type(e).__name__, getattr(e, "tier", None)) for e in batch.events)
        assert replayer.tiers[DEVICE] == set(s.kv_cache_manager.block_pool.cached)
        assert replayer.tiers[HOST] == set(s.kv_tiering.host.cached)

    run_workload(s, rng, 150, on_step=compare)
    assert s.reset_prefix_cache()
    compare(s)
    assert not replayer.tiers[DEVICE] and not replayer.tiers[HOST]
    assert {
        ("BlockStored", DEVICE),
        ("BlockStored", HOST),
        ("BlockRemoved", DEVICE),
        ("BlockRemoved", HOST),
        ("AllCleared", None),
    } <= kinds


def test_a_lagging_subscriber_gets_a_snapshot_and_a_lost_batch_is_detected():
    rng = random.Random(5)
    s = make_scheduler(num_blocks=27, num_offload_blocks=10, events=True, block_size=2)
    slow = s.kv_tiering.events.subscribe(max_pending=2)
    lossy = s.kv_tiering.events.subscribe()
    run_workload(s, rng, 60)
    batch = slow.get(timeout=0)
    assert batch.snapshot and batch.num_dropped > 2 and isinstance(batch.events[0], AllCleared)
    replayer = KVEventReplayer()
    replayer.apply(batch)
    assert replayer.tiers[DEVICE] == set(s.kv_cache_manager.block_pool.cached)
    assert replayer.tiers[HOST] == set(s.kv_tiering.host.cached)
    assert slow.get(timeout=0) is None
    # A reader that loses one batch in transit sees the gap.
    replayer = KVEventReplayer()
    replayer.apply(lossy.get(timeout=0))
    replayer.apply(lossy.get(timeout=0))
    lossy.get(timeout=0)  # lost
    with pytest.raises(KVEventGap, match="events were lost"):
        replayer.apply(lossy.get(timeout=0))


def test_a_request_that_computes_its_whole_prompt_recomputes_instead_of_swapping():
    """Prompt logprobs (and MEAN/CLS pooling) need every prompt position computed:
    such a request is never swapped, so resuming recomputes it from position 0."""
    s = make_scheduler(num_blocks=17, num_offload_blocks=200, budget=64)
    rng = random.Random(7)
    for i in range(8):
        prompt = [rng.randint(1, 11) for _ in range(12)]
        s.add_request(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=0),
                eos_token_id=EOS,
                arrival_time=float(i),
            )
        )
    swapped_seen = []
    run_workload(s, rng, 0, on_step=lambda s: swapped_seen.append(bool(s.kv_tiering.swapped)))
    stats = s.make_stats()
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0
    assert not any(swapped_seen)


def test_a_fresh_scheduler_keeps_the_event_subscribers_and_tells_them_all_was_cleared():
    rng = random.Random(9)
    old = make_scheduler(num_blocks=27, num_offload_blocks=10, events=True, block_size=2)
    sub = old.kv_tiering.events.subscribe()
    replayer = KVEventReplayer()
    run_workload(old, rng, 30)
    new = make_scheduler(num_blocks=27, num_offload_blocks=10, events=True, block_size=2)
    new.kv_tiering.take_over_events(old.kv_tiering)  # as EngineCore.discard_requests does
    run_workload(new, rng, 30)
    while (batch := sub.get(timeout=0)) is not None:
        replayer.apply(batch)
    assert replayer.tiers[DEVICE] == set(new.kv_cache_manager.block_pool.cached)
    assert replayer.tiers[HOST] == set(new.kv_tiering.host.cached)
