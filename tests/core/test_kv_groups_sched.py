"""Admission, displacement and the admission reserve count the blocks of every
KV cache group (core/kv/groups.py), not only the first group's.

The oracle: a model with two groups whose sliding window is longer than any
request behaves, block for block, like one full-attention group with half the
pool (each group mirrors the other). So with prefix caching off, a two-group
scheduler with ``2 * N + 1`` blocks must schedule exactly what a one-group
scheduler with ``N + 1`` blocks schedules, step for step: any heuristic that
counts the first group's blocks only (needs ``N`` where the allocation takes
``2 * N``) admits or displaces differently."""

from __future__ import annotations

import random

import pytest

from tokenbudget.core.kv.groups import HybridKVCacheManager

WIDE = 10_000  # a window no request here reaches: the group acts as full attention


def _schedules(make_scheduler, make_request, run_to_completion, groups: int, specs, **config):
    usable = config.pop("usable")
    s = make_scheduler(
        num_blocks=groups * usable + 1,
        kv_group_windows=(0, WIDE)[:groups],
        enable_prefix_caching=False,
        **config,
    )
    if groups > 1:
        assert isinstance(s.kv_cache_manager, HybridKVCacheManager)
    for rid, prompt, max_tokens, priority in specs:
        s.add_request(make_request(rid, prompt, max_tokens=max_tokens, priority=priority))
    run = run_to_completion(s)
    preempted = [sorted(so.preempted_req_ids) for so in run.outputs]
    return run.schedules, preempted, run.tokens


def test_displacement_takes_as_many_victims_as_every_group_needs(
    make_scheduler, make_request, step
):
    """Three running requests hold 2 blocks in each of 2 groups (all 12
    blocks); an urgent 60-token prompt needs 4 blocks in each group. One
    victim gives back 4 blocks, which the first group alone would take: it
    must displace two, in this step, and start at once."""
    s = make_scheduler(policy="priority", num_blocks=13, kv_group_windows=(0, WIDE), block_size=16)
    for i in range(3):
        s.add_request(make_request(f"bg{i}", 20, priority=20, max_tokens=4))
    step(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    s.add_request(make_request("urgent", 60, priority=0, max_tokens=2))
    so, _ = step(s)
    assert so.num_scheduled_tokens.get("urgent") == 60
    assert so.preempted_req_ids == {"bg1", "bg2"}  # latest arrivals, only as many as needed


def test_no_victim_is_displaced_when_every_victim_together_cannot_make_room(
    make_scheduler, make_request, step
):
    """Two victims free 8 blocks; the urgent prompt needs 6 per group (12):
    nobody may be displaced for nothing."""
    s = make_scheduler(policy="priority", num_blocks=13, kv_group_windows=(0, WIDE), block_size=16)
    s.add_request(make_request("vip", 20, priority=0, max_tokens=4))
    for i in range(2):
        s.add_request(make_request(f"bg{i}", 20, priority=20, max_tokens=4))
    step(s)
    s.add_request(make_request("urgent", 90, priority=0, max_tokens=2))
    so, _ = step(s)
    assert "urgent" not in so.num_scheduled_tokens
    assert so.preempted_req_ids == set()


@pytest.mark.parametrize(
    "config",
    [
        dict(policy="priority"),  # displacement plans
        dict(policy="fcfs", admission_reserve=True),  # the reserve's admission test
        dict(policy="lpm"),  # the reserve is on for cache-aware orders
    ],
    ids=["priority", "fcfs-reserve", "lpm"],
)
def test_two_mirrored_groups_schedule_like_one_group_with_half_the_pool(
    make_scheduler, make_request, run_to_completion, config
):
    rng = random.Random(11)
    for trial in range(6):
        specs = [
            (f"t{trial}r{i}", rng.randint(3, 40), rng.randint(1, 24), rng.choice([0, 5, 20]))
            for i in range(rng.randint(4, 12))
        ]
        kw = dict(
            config,
            usable=rng.randint(12, 30),
            block_size=4,
            max_num_batched_tokens=rng.choice([16, 32, 64]),
            max_num_seqs=rng.choice([3, 8]),
        )
        one = _schedules(make_scheduler, make_request, run_to_completion, 1, specs, **dict(kw))
        two = _schedules(make_scheduler, make_request, run_to_completion, 2, specs, **dict(kw))
        assert two == one, (trial, specs, kw)


def test_reserve_counts_a_sliding_group_up_to_its_window_per_request(make_request):
    """A full group grows by every expected token, a sliding (chunked) group by
    at most its window (chunk) of each request's tokens: it frees what leaves."""
    from tokenbudget.core import SchedulerConfig
    from tokenbudget.core.policy.reserve import AdmissionReserve

    reserve = AdmissionReserve(
        SchedulerConfig(init_new_token_ratio=1.0, reserve_clip_tokens=10_000), block_size=4
    )
    long, short = make_request("long", 4, max_tokens=40), make_request("short", 4, max_tokens=6)
    assert reserve.reserve_blocks([long, short]) == (40 + 6) / 4
    assert reserve.reserve_blocks([long, short], (0, 8)) == (40 + 6 + 8 + 6) / 4
    assert reserve.reserve_blocks([long, short], (8, 16)) == (8 + 6 + 16 + 6) / 4
    # A chunked local group (window -C, core/kv/groups.py) holds at most a chunk.
    assert reserve.reserve_blocks([long, short], (0, -8)) == (40 + 6 + 8 + 6) / 4
