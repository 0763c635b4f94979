"""KV cache groups (core/kv/groups.py): one table per attention type over one
pool, sliding-window and chunked local groups giving blocks back, and the
prefix hit every group can serve, checked against a brute force over the
cached blocks."""

from __future__ import annotations

import random

from tokenbudget.core import CacheConfig, Request, SamplingParams
from tokenbudget.core.kv import KVCacheManager
from tokenbudget.core.kv.events import KVEventReplayer
from tokenbudget.core.kv.groups import HybridKVCacheManager, chunked, group_layers
from tokenbudget.core.kv.tiering import make_kv_cache_manager

BS = 4


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=64), eos_token_id=None)


def _run(kv: HybridKVCacheManager, req: Request, chunk: int, steps: int, check=None) -> None:
    """Admit ``req`` with its prefix hit, then compute ``chunk`` tokens a step
    (decoding one token a step once its prompt is done)."""
    hits, num_cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = 0
    n = min(chunk, req.num_tokens - num_cached)
    assert kv.allocate_slots(req, n, hits, num_cached) is not None
    req.num_computed_tokens = num_cached + n
    for _ in range(steps):
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([len(req.all_token_ids) % 7])
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        if check is not None:
            check(req)
        kv.block_pool.check_invariants()


def test_one_full_group_is_todays_manager():
    kv = make_kv_cache_manager(CacheConfig(block_size=BS, num_blocks=8))
    assert type(kv) is KVCacheManager
    kv = make_kv_cache_manager(CacheConfig(block_size=BS, num_blocks=8, kv_group_windows=(0,)))
    assert type(kv) is KVCacheManager


def test_layers_group_full_first_then_by_window():
    assert group_layers([8, 0, 8, 0, 4]) == ((0, 4, 8), [2, 0, 2, 0, 1])


def test_layers_group_full_then_windows_then_chunks():
    c16, c4 = chunked(16), chunked(4)
    assert group_layers([c16, 8, 0, c4, c16]) == ((0, 8, c4, c16), [3, 1, 0, 2, 3])
    assert group_layers([c16, c16, c16, 0]) == ((0, c16), [1, 1, 1, 0])


def test_block_ids_interleave_groups_and_allocation_takes_both():
    kv = HybridKVCacheManager(20, BS, (0, 6))
    req = _request("a", list(range(9)))
    ids = kv.allocate_slots(req, 9)
    assert len(ids) == 6  # 3 blocks in each group
    assert kv.get_block_ids("a") == ids
    assert [t[1].block_id for t in kv.group_tables("a")] == ids[2:4]


def test_allocation_is_all_or_nothing_across_groups():
    kv = HybridKVCacheManager(6, BS, (0, 6))  # 5 usable blocks
    req = _request("a", list(range(12)))  # 3 blocks per group: 6 > 5
    assert kv.allocate_slots(req, 12) is None
    assert kv.block_pool.get_num_free_blocks() == 5 and not kv.tables


def test_a_long_request_holds_a_window_of_blocks_in_a_sliding_group():
    window = 10
    kv = HybridKVCacheManager(40, BS, (window,))
    req = _request("a", list(range(3 * window)))
    bound = -(-window // BS) + 2

    def check(r: Request) -> None:
        assert kv.num_held_blocks("a", 0) <= bound, kv.group_tables("a")

    _run(kv, req, BS, 10 * window, check)
    assert req.num_computed_tokens >= 10 * window
    kv.free(req)
    kv.block_pool.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == 39


def _sees(window: int, query: int, key: int) -> bool:
    """Whether a query at position ``query`` attends to ``key`` (window 0:
    full, W > 0: its last W positions, -C: the positions of its chunk of C)."""
    if key > query:
        return False
    if window > 0:
        return query - key < window
    if window < 0:
        return key // -window == query // -window
    return True


def test_a_long_request_holds_a_chunk_of_blocks_in_a_chunked_group():
    chunk = 10
    kv = HybridKVCacheManager(40, BS, (0, chunked(chunk)))
    req = _request("a", list(range(3 * chunk)))
    bound = -(-chunk // BS) + 2
    null = kv.block_pool.null_block
    computed = [BS]  # when the step's blocks were allocated (the first step: after admission)

    def check(r: Request) -> None:
        assert kv.num_held_blocks("a", 1) <= bound, kv.group_tables("a")
        # Exactly the blocks before the chunk of the step's first position are given back.
        start = computed[0] // chunk * chunk
        table = kv.group_tables("a")[1]
        assert [b is null for b in table] == [i < start // BS for i in range(len(table))]
        computed[0] = r.num_computed_tokens

    _run(kv, req, BS, 6 * chunk, check)
    assert kv.num_held_blocks("a", 0) == -(-req.num_computed_tokens // BS)
    kv.free(req)
    kv.block_pool.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == 39


def test_a_hit_at_a_chunk_start_needs_no_block_of_the_chunked_group():
    kv = HybridKVCacheManager(40, BS, (0, chunked(8)))
    prompt = list(range(30))
    first = _request("a", prompt)
    kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.free(first)
    kv.block_pool.cached.pop(kv._key(kv.hasher.update(first)[5], 1))  # block 5 (20..23)
    # A query at 24 (a chunk start) reads no cached block of the chunked group;
    # at 28 it would need block 6 and, from 24, nothing missing, so 28 is a hit
    # too, but at 20..23 it would read block 5 with the missing key.
    second = _request("b", prompt + [1, 2])
    hits, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 28 == _brute_force_hit(kv, second)
    full, local = hits.tables
    assert [b.block_id == 0 for b in local] == [True] * 6 + [False]
    assert 0 not in [b.block_id for b in full]


def _brute_force_hit(kv: HybridKVCacheManager, req: Request) -> int:
    """The longest k blocks such that every group holds, cached, each of the
    first k blocks holding a key the query at position k * BS reads."""
    hashes = kv.hasher.update(req)
    max_k = min(len(hashes), (req.num_tokens - 1) // BS)
    cached = kv.block_pool.cached
    for k in range(max_k, 0, -1):
        ok = True
        for g, w in enumerate(kv.windows):
            for i in range(k):
                if any(_sees(w, k * BS, t) for t in range(i * BS, (i + 1) * BS)):
                    key = hashes[i] if g == 0 else hashes[i] + bytes((g,))
                    ok &= key in cached
        if ok:
            return k * BS
    return 0


def test_prefix_hit_is_what_every_group_can_serve_by_brute_force():
    rng = random.Random(0)
    for trial in range(40):
        windows = rng.choice(
            [(0, 5), (0, 9), (7,), (0, 6, 13), (0, -6), (0, -8), (-9,), (0, 5, -12)]
        )
        kv = HybridKVCacheManager(rng.randint(12, 40), BS, windows)
        base = [rng.randrange(50) for _ in range(40)]
        for i in range(rng.randint(1, 6)):
            cut = rng.randint(0, 40)
            prompt = base[:cut] + [rng.randrange(50) for _ in range(rng.randint(1, 12))]
            req = _request(f"r{trial}-{i}", prompt)
            hits, num_cached = kv.get_computed_blocks(req)
            assert num_cached == _brute_force_hit(kv, req), (trial, i, windows)
            for g, table in enumerate(hits.tables if hits else ()):
                assert len(table) * BS == num_cached
            n = req.num_tokens - num_cached
            if kv.allocate_slots(req, n, hits, num_cached) is None:
                continue
            req.num_computed_tokens = req.num_tokens
            # Advance a few tokens (sliding groups free blocks), then finish.
            for _ in range(rng.randint(0, 6)):
                req.append_output_token_ids([rng.randrange(50)])
                if kv.allocate_slots(req, 1) is None:
                    break
                req.num_computed_tokens += 1
            kv.block_pool.check_invariants()
            kv.free(req)
        kv.block_pool.check_invariants()
        assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable


def test_hit_tables_null_what_the_window_cannot_see():
    kv = HybridKVCacheManager(40, BS, (0, 5))
    prompt = list(range(30))
    first = _request("a", prompt)
    kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.free(first)
    second = _request("b", prompt + [1, 2])
    hits, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 28
    full, sliding = hits.tables
    assert 0 not in [b.block_id for b in full]
    # A query at position 28 reads keys 24..28: blocks 6 (and the new one).
    assert [b.block_id == 0 for b in sliding] == [True] * 6 + [False]


def test_kv_events_name_every_groups_blocks_by_hash_and_group():
    stored, removed = [], []
    kv = make_kv_cache_manager(
        CacheConfig(block_size=BS, num_blocks=9, kv_group_windows=(0, 5)),
        on_store=lambda h, parent, tokens, group: stored.append((h, group)),
        on_evict=lambda block, h, group: removed.append((h, group)),
    )
    first = _request("a", list(range(12)))
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.free(first)
    hashes = kv.hasher.update(first)  # 3 full blocks in each group
    assert stored == [(h, g) for g in (0, 1) for h in hashes]
    other = _request("b", list(range(100, 116)))  # 4 blocks per group: evicts all 6 cached
    assert kv.allocate_slots(other, 16) is not None
    assert sorted(removed) == sorted(stored[:6])


def test_replayed_events_hold_each_groups_cached_hashes():
    from tokenbudget.core.kv.events import DEVICE
    from tokenbudget.core.kv.tiering import KVTiering
    from tokenbudget.proto import convert

    cfg = CacheConfig(
        block_size=BS, num_blocks=9, kv_group_windows=(0, 5), enable_kv_cache_events=True
    )
    tiering = KVTiering(cfg)
    kv, events = tiering.kv, tiering.events
    sub = events.subscribe()
    first = _request("a", list(range(12)))
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.free(first)
    events.flush()
    second = _request("b", list(range(100, 108)))
    kv.allocate_slots(second, 8)  # 2 blocks per group: 2 free ones, then evicts 2 cached
    events.flush()
    replayer = KVEventReplayer()
    for _ in range(3):  # the snapshot, then both batches, through the gRPC message
        replayer.apply(
            convert.kv_event_batch_from_proto(convert.kv_event_batch_to_proto(sub.get(0)))
        )
    cached = kv.block_pool.cached
    hashes = kv.hasher.update(first) + kv.hasher.update(second)
    for g in (0, 1):
        want = {h for h in hashes if kv._key(h, g) in cached}
        assert replayer.groups[g][DEVICE] == want == events.cached_hashes(g)[DEVICE]
    assert sum(len(replayer.groups[g][DEVICE]) for g in (0, 1)) == len(cached) == 8
    assert replayer.tiers is replayer.groups[0]
    late = KVEventReplayer()
    late.apply(events.subscribe().get(0))  # a snapshot names the groups too
    assert late.groups == replayer.groups


def test_blocks_in_use_per_group_count_each_groups_held_blocks_once():
    kv = HybridKVCacheManager(60, BS, (0, 6))
    a = _request("a", list(range(20)))
    _run(kv, a, 4, 10)  # past its prompt: the window gave blocks back
    b = _request("b", list(range(20)) + [99, 98])  # a prefix hit on a's blocks
    _run(kv, b, 4, 2)
    used = kv.blocks_in_use_per_group()
    oracle = [
        len({blk.block_id for rid in "ab" for blk in kv.group_tables(rid)[g] if blk.block_id})
        for g in range(2)
    ]
    assert used == oracle
    held = [kv.num_held_blocks("a", g) + kv.num_held_blocks("b", g) for g in range(2)]
    assert used[0] < held[0]  # shared prefix blocks count once
    assert used[1] < used[0]  # the sliding group holds a window's worth
    pool = kv.block_pool
    assert sum(used) == pool.num_usable - pool.get_num_free_blocks()
    kv.free(a)
    kv.free(b)
    assert kv.blocks_in_use_per_group() == [0, 0]


def test_one_group_manager_reports_its_blocks_as_one_full_group():
    kv = make_kv_cache_manager(CacheConfig(block_size=BS, num_blocks=8))
    kv.allocate_slots(_request("a", list(range(9))), 9)
    assert (kv.windows, kv.blocks_in_use_per_group()) == ((0,), [3])


def test_preempted_blocks_never_computed_leave_every_groups_events():
    from tokenbudget.core.kv.events import DEVICE
    from tokenbudget.core.kv.tiering import KVTiering

    cfg = CacheConfig(
        block_size=BS, num_blocks=9, kv_group_windows=(0, 5), enable_kv_cache_events=True
    )
    tiering = KVTiering(cfg)
    kv, events = tiering.kv, tiering.events
    req = _request("a", list(range(12)))
    kv.allocate_slots(req, 12)  # its 3 full blocks are hashed when scheduled
    events.flush()
    assert all(len(events.cached_hashes(g)[DEVICE]) == 3 for g in (0, 1))
    tiering.on_preempt(req)  # preempted before that step ran: nothing computed
    events.flush()
    assert not kv.block_pool.cached
    assert events.cached_hashes(0)[DEVICE] == events.cached_hashes(1)[DEVICE] == set()
