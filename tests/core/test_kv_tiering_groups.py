"""The host KV tier with KV cache groups (core/kv/tiering.py over
core/kv/groups.py): every group's blocks swap out and back, host prefix hits
serve what every group can, and a block no query of its group reads is never
left cached without its KV. Checked against a KV oracle that reads, per
group, exactly the positions the worker's attention reads."""

from __future__ import annotations

import random

import pytest

from tokenbudget.core import (
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.core.kv.events import DEVICE, HOST, KVEventReplayer

from .conftest import KVOracle, kv_id
from .test_kv_tiering import EOS, check_tiers, random_request, sample


class GroupKVOracle(KVOracle):
    """KVOracle over tables interleaving the groups (block j of group g at
    j * G + g): a sliding group of window W is read only at the W - 1
    positions before each query; every group is written at every position,
    with KV that names its group (a block copied into the wrong group's
    table is a wrong read)."""

    def __init__(self, block_size: int, windows: tuple[int, ...]) -> None:
        super().__init__(block_size)
        self.windows = windows

    def step(self, s: Scheduler, so: SchedulerOutput) -> None:
        starts = self.copy_and_track(so)
        bs, num_groups = self.bs, len(self.windows)
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            tokens = s.requests[rid].all_token_ids + so.scheduled_spec_decode_tokens.get(rid, [])
            table = self.tables[rid]
            for g, window in enumerate(self.windows):
                first = 0 if window == 0 else max(0, start - window + 1)
                for p in range(first, start):
                    block = table[(p // bs) * num_groups + g]
                    got = self._block(self.device, block)[p % bs]
                    assert got == (g, kv_id(tokens, p)), (
                        f"{rid} reads wrong KV at position {p} of group {g} (block {block})"
                    )
                    self.num_reads += 1
                for p in range(start, start + n):
                    block = table[(p // bs) * num_groups + g]
                    self._block(self.device, block)[p % bs] = (g, kv_id(tokens, p))


def make_scheduler(
    windows, num_blocks: int, host: int | None, *, block_size: int = 4, **kw
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=kw.get("budget", 32),
            max_num_seqs=8,
            max_model_len=128,
            policy=kw.get("policy", "fcfs"),
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            num_offload_blocks=host,
            kv_load_blocks_per_step=kw.get("load_budget", 256),
            enable_kv_cache_events=kw.get("events", False),
            kv_group_windows=windows,
        ),
    )


def drive(s: Scheduler, oracle: GroupKVOracle, outputs: dict, on_step=None) -> None:
    so = s.schedule()
    oracle.step(s, so)
    if not so.is_empty:
        for out in s.update_from_output(so, sample(s, so)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    check_tiers(s)
    if on_step is not None:
        on_step(s, so)


def run_workload(s: Scheduler, rng: random.Random, num_ops: int, on_step=None):
    oracle = GroupKVOracle(s.cache_config.block_size, s.cache_config.kv_group_windows)
    outputs: dict[str, list[int]] = {}
    n = 0
    for _ in range(num_ops):
        if rng.random() < 0.3:
            s.add_request(random_request(rng, f"r{n}"))
            n += 1
        else:
            drive(s, oracle, outputs, on_step)
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        drive(s, oracle, outputs, on_step)
    assert not s.has_unfinished_requests()
    return outputs, oracle


def assert_all_free(s: Scheduler) -> None:
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable
    t = s.kv_tiering
    assert not t.swapped
    assert t.host.get_num_free_blocks() == t.host.num_usable
    assert all(slot.ref_cnt == 0 for slot in t.host.blocks)


@pytest.mark.parametrize("windows", [(0, 5), (0, 9), (6,)])
def test_random_workloads_with_groups_read_only_their_own_kv(windows):
    totals = {"swap_in": 0, "host_hits": 0, "reads": 0}
    for seed in range(6):
        rng = random.Random(seed)
        bs = rng.choice([2, 4])
        s = make_scheduler(
            windows,
            # One request at its longest in every group, and a little more.
            num_blocks=len(windows) * 48 // bs + 1 + rng.randint(0, 6),
            host=rng.choice([4, 16, 80]),
            block_size=bs,
            load_budget=rng.choice([1, 3, 256]),
            budget=rng.choice([8, 32]),
        )
        _, oracle = run_workload(s, rng, 100)
        assert_all_free(s)
        stats = s.make_stats()
        totals["swap_in"] += stats.kv_swap_in_blocks
        totals["host_hits"] += s.kv_tiering.num_host_hit_tokens
        totals["reads"] += oracle.num_reads
    assert all(totals.values()), totals


def _pressure(windows, host: int | None):
    """Eight requests growing past a pool that holds about half of them."""
    rng = random.Random(7)
    s = make_scheduler(windows, num_blocks=len(windows) * 16 + 1, host=host, budget=64)
    for i in range(8):
        prompt = [rng.randint(1, 11) for _ in range(12)]
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        s.add_request(Request(f"r{i}", prompt, params, eos_token_id=EOS, arrival_time=float(i)))
    return run_workload(s, rng, 0)[0], s


@pytest.mark.parametrize("windows", [(0, 6), (7,)])
def test_swapped_requests_restore_every_group_and_recompute_nothing(windows):
    reference, s0 = _pressure(windows, None)
    assert s0.make_stats().num_recomputed_tokens > 0
    swapped, s = _pressure(windows, 200)
    stats = s.make_stats()
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens == 0
    assert stats.kv_swap_out_blocks > 0 and stats.kv_swap_in_blocks > 0
    assert swapped == reference
    assert_all_free(s)


def test_a_swap_stores_only_the_blocks_the_window_still_needs():
    windows, bs = (0, 6), 4
    s = make_scheduler(windows, num_blocks=40, host=40, block_size=bs, budget=64)
    prompt = list(range(1, 30))  # 29 tokens: 8 blocks in each group
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=4), eos_token_id=EOS))
    oracle, outputs = GroupKVOracle(bs, windows), {}
    drive(s, oracle, outputs)
    drive(s, oracle, outputs)  # one token decoded: 30 computed
    req = s.requests["a"]
    s.preemptor.preempt(req, _Step(), s.running)
    record = s.kv_tiering.swapped["a"]
    full, sliding = record.tables
    # Full attention keeps all 8 blocks; the window (6) needs the last
    # positions 25-29 before the next query: blocks 6 and 7 only.
    assert all(slot is not None for slot in full)
    assert [i for i, slot in enumerate(sliding) if slot is not None] == [6, 7]
    assert len(record.slots) == 10
    while s.has_unfinished_requests():
        drive(s, oracle, outputs)
    assert s.make_stats().num_recomputed_tokens == 0
    assert_all_free(s)


class _Step:
    """What Preemption.preempt reads of a step, for a victim not scheduled in it."""

    def __init__(self) -> None:
        self.preempted: list[Request] = []

    def unschedule(self, req: Request) -> None:
        pass


def test_host_prefix_hits_serve_every_group_and_events_name_the_group():
    windows, bs = (0, 6), 4
    s = make_scheduler(
        windows, num_blocks=2 * 12 + 1, host=64, block_size=bs, events=True, budget=64
    )
    sub = s.kv_tiering.events.subscribe()
    replayer = KVEventReplayer()
    shared = list(range(1, 33))  # 8 full blocks
    oracle, outputs = GroupKVOracle(bs, windows), {}

    def run(rid: str, prompt: list[int]) -> None:
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=2), eos_token_id=EOS))
        while s.has_unfinished_requests():
            drive(s, oracle, outputs)
            while (batch := sub.get(timeout=0)) is not None:
                replayer.apply(batch)

    run("a", shared + [40])
    # 46 tokens in one chunk take all 24 blocks: a's are spilled to the host.
    run("b", [50 + i % 7 for i in range(46)])
    keys = shared_keys(s, shared)
    assert not s.kv_cache_manager.block_pool.cached.keys() & set(keys)
    assert set(keys) <= replayer.groups[0][HOST] and set(keys) <= replayer.groups[1][HOST]
    copied = s.kv_tiering.num_swapped_in_blocks
    run("c", shared + [41])
    # Full group: blocks 0-7 loaded; the window (6) reads blocks 6 and 7 only.
    assert s.kv_tiering.num_host_hit_tokens == 32
    assert s.kv_tiering.num_swapped_in_blocks - copied == 8 + 2
    # Blocks 0-5 of the window's group got no KV: none stays cached.
    assert set(keys) <= replayer.groups[0][DEVICE]
    assert set(keys[6:]) <= replayer.groups[1][DEVICE]
    assert not set(keys[:6]) & replayer.groups[1][DEVICE]
    assert_all_free(s)


def shared_keys(s: Scheduler, prompt: list[int]) -> list[bytes]:
    """The block hashes of ``prompt``'s full blocks."""
    probe = Request("probe", prompt, SamplingParams(), eos_token_id=EOS)
    return s.kv_cache_manager.hasher.update(probe)
