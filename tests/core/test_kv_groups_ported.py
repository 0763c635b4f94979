"""vLLM's hybrid and sliding-window KV cache unit tests, as behaviours of our
KV cache groups (core/kv/groups.py): each test names the vLLM test whose
behaviour it checks (tests/v1/core/test_single_type_kv_cache_manager.py,
test_prefix_caching.py, test_kv_cache_utils.py). Written against our API,
not copied; exact block ids follow our layout (a step's new blocks are dealt
to the groups in turn), and every hit is also checked by brute force."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tokenbudget.core import Request, SamplingParams
from tokenbudget.core.kv.groups import HybridKVCacheManager, chunked
from tokenbudget.core.policy.base import blocks_to_admit


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=64), eos_token_id=None)


def _key(kv: HybridKVCacheManager, req: Request, i: int, g: int) -> bytes:
    """The prefix-cache key of block ``i`` of ``req`` in group ``g``."""
    return kv._key(kv.hasher.update(req)[i], g)


def _brute_force_hit(kv: HybridKVCacheManager, req: Request) -> int:
    """Tokens of the longest prefix of ``k`` blocks such that every group
    holds, cached, each block a query at position ``k * block_size`` reads."""
    bs = kv.block_size
    max_k = min(len(kv.hasher.update(req)), (req.num_tokens - 1) // bs)
    for k in range(max_k, 0, -1):
        if all(
            _key(kv, req, i, g) in kv.block_pool.cached
            for g, w in enumerate(kv.windows)
            for i in range((0 if w == 0 else max(0, k * bs - w + 1)) // bs, k)
        ):
            return k * bs
    return 0


def _compute(kv: HybridKVCacheManager, req: Request) -> None:
    """Admit ``req`` with its hit and compute its whole prompt."""
    hits, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, hits, num_cached) is not None
    req.num_computed_tokens = req.num_tokens


def _ids(table) -> list[int]:
    return [b.block_id for b in table]


# -- test_single_type_kv_cache_manager.py -------------------------------------------
@pytest.mark.parametrize(
    "cached, expect",
    [
        ([False] * 10, 0),
        ([True], 1),
        ([True, False], 1),
        ([True, True], 2),
        ([True, True, False], 2),
        ([True, True, True], 3),
        ([True, True, True, False], 3),
        ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
        ([True, True, False, True, False, False, True, True, False, False, False], 8),
        ([True, True, False, True, False, False, True, True, False, False, False, True], 8),
    ],
)
def test_sliding_window_hit_is_the_longest_prefix_whose_last_window_is_cached(cached, expect):
    """vLLM test_sliding_window_possible_cached_prefix: window 4, block 2 (a
    query reads the 3 tokens before it: the last 2 blocks of the prefix).
    Gaps before the last window do not matter; the hit table holds the null
    block where the window cannot see and the cached blocks in the window."""
    kv = HybridKVCacheManager(100, 2, (4,))
    req = _request("r", list(range(2 * len(cached) + 1)))  # a hit may cover every block
    for i, is_cached in enumerate(cached):
        if is_cached:
            kv.block_pool.cache_block(kv.block_pool.blocks[i + 10], _key(kv, req, i, 0))
    hits, num_cached = kv.get_computed_blocks(req)
    assert num_cached == 2 * expect == _brute_force_hit(kv, req)
    table = hits.tables[0]
    assert len(table) == expect
    assert all(b is kv.block_pool.null_block for b in table[: max(expect - 2, 0)])
    assert _ids(table[max(expect - 2, 0) :]) == [i + 10 for i in range(max(expect - 2, 0), expect)]


def test_sliding_window_frees_blocks_every_future_query_is_past():
    """vLLM test_sliding_window_remove_skipped_blocks: window 4, block 2. With
    4 tokens computed only token 0 is out of the window (its block still holds
    token 1); at 5 block 0 goes, at 6 nothing more (token 3 is still read), at
    7 block 1, at 11 blocks 2 and 3. Freed blocks return to the pool."""
    kv = HybridKVCacheManager(40, 2, (4,))
    req = _request("r", list(range(22)))
    assert len(kv.allocate_slots(req, 22)) == 11
    null = kv.block_pool.null_block
    pool = kv.block_pool
    for computed, num_null in [(0, 0), (4, 0), (5, 1), (6, 1), (7, 2), (11, 4)]:
        req.num_computed_tokens = computed
        free = pool.get_num_free_blocks()
        before = [b for b in kv.group_tables("r")[0] if b is not null]
        assert kv.allocate_slots(req, 0) == []
        table = kv.group_tables("r")[0]
        assert [b is null for b in table] == [True] * num_null + [False] * (11 - num_null)
        gone = [b for b in before if b not in table]
        assert pool.get_num_free_blocks() == free + len(gone)
        assert all(b.ref_cnt == 0 for b in gone)
        pool.check_invariants()


@pytest.mark.xfail(
    strict=True,
    reason="groups.py frees skipped blocks oldest first; vLLM frees them tail first "
    "(the longer prefix is evicted earlier), as our free() does for a full group",
)
def test_blocks_leaving_the_window_together_are_evicted_tail_first():
    """vLLM test_sliding_window_remove_skipped_blocks (last step): blocks 2
    and 3 leave the window in one step; block 3 ends a longer prefix and is
    expected to be evicted before block 2."""
    kv = HybridKVCacheManager(40, 2, (4,))
    req = _request("r", list(range(22)))
    kv.allocate_slots(req, 22)
    req.num_computed_tokens = 7
    kv.allocate_slots(req, 0)  # blocks 0 and 1 leave
    third, fourth = kv.group_tables("r")[0][2:4]
    req.num_computed_tokens = 11
    kv.allocate_slots(req, 0)  # blocks 2 and 3 leave together
    queue = list(kv.block_pool.free_queue)
    assert queue.index(fourth) < queue.index(third)


def test_allocation_counts_new_and_revived_hit_blocks_of_every_group():
    """vLLM test_get_num_blocks_to_allocate and
    test_evictable_cached_blocks_not_double_allocated: a hit block sitting in
    the free queue costs a free block (it stops being free), a null entry of
    a sliding group's hit table costs nothing, and only the blocks past the
    hit are newly taken. Checked at the all-or-nothing edge: with one block
    fewer than that count free, nothing is allocated."""
    for windows, need in [((4,), 1 + 2), ((0, 4), 2 * 1 + 20 + 2)]:
        prompt = list(range(41))  # 20 full blocks and one token
        for spare in (0, -1):
            kv = HybridKVCacheManager(60, 2, windows)
            _compute(kv, _request("a", prompt))
            kv.free(_request("a", prompt))
            second = _request("b", prompt)
            hits, num_cached = kv.get_computed_blocks(second)
            assert num_cached == 40
            assert blocks_to_admit(kv, hits, num_cached, 1) == need
            # Hold free blocks other than the hits, so exactly need + spare are left.
            pool = kv.block_pool
            hit = {id(b) for t in hits.tables for b in t}
            others = [b for b in pool.free_queue if id(b) not in hit]
            held = others[: pool.get_num_free_blocks() - need - spare]
            pool.touch(held)
            assert pool.get_num_free_blocks() == need + spare
            got = kv.allocate_slots(second, 1, hits, num_cached)
            if spare < 0:
                assert got is None and "b" not in kv.tables
            else:
                assert len(got) == len(windows)  # one new block per group
                assert pool.get_num_free_blocks() == 0
            kv.block_pool.free_blocks(held)
            kv.block_pool.check_invariants()


def test_predicted_blocks_equal_what_admission_takes_from_the_pool():
    """vLLM test_predictor_matches_allocator_blocks_calculation: the blocks
    the scheduler's heuristics expect an admission to take (blocks_to_admit,
    core/policy/base.py) are exactly what allocate_slots takes, over random
    prompts sharing prefixes, with one to three groups (a chunked local one
    among them); and it fails exactly
    when that is more than is free."""
    rng = random.Random(5)
    for trial in range(60):
        windows = rng.choice([(0,), (6,), (0, 6), (0, 5, 11), (0, 8, 8), (0, 6, chunked(8))])
        kv = HybridKVCacheManager(rng.randint(10, 50), 4, windows)
        base = [rng.randrange(30) for _ in range(48)]
        live = []
        for i in range(rng.randint(2, 8)):
            req = _request(f"{trial}-{i}", base[: rng.randint(0, 48)] + [rng.randrange(30)] * 3)
            hits, num_cached = kv.get_computed_blocks(req)
            n = rng.randint(1, req.num_tokens - num_cached)
            need = blocks_to_admit(kv, hits, num_cached, n)
            free = kv.block_pool.get_num_free_blocks()
            got = kv.allocate_slots(req, n, hits, num_cached)
            assert (got is None) == (need > free), (trial, i, need, free)
            assert free - kv.block_pool.get_num_free_blocks() == (0 if got is None else need)
            if got is not None:
                req.num_computed_tokens = num_cached + n
                live.append(req)
            if live and rng.random() < 0.4:
                kv.free(live.pop(rng.randrange(len(live))))
            kv.block_pool.check_invariants()


# -- test_prefix_caching.py ---------------------------------------------------------
def test_prefill_hybrid_model_hits_every_group_and_agrees_on_the_hit_length():
    """vLLM test_prefill_hybrid_model: a full group and two sliding groups of a
    2-block window. The first request's full blocks are cached in every group
    under that group's key; a second request sharing them hits all three
    blocks (the sliding tables start with the null block, out of the window)
    and takes one new block per group. Then, hiding cached blocks, the hit is
    what every group can serve: a sliding group's out-of-window block does not
    matter; a full group's first block does; the last block of any group cuts
    the hit to 2; and groups serving different lengths agree on none."""
    bs = 4
    kv = HybridKVCacheManager(21, bs, (0, 2 * bs, 2 * bs))
    common = [i for i in range(3) for _ in range(bs)]
    first = _request("0", common + [3] * 3)
    hits, num_cached = kv.get_computed_blocks(first)
    assert num_cached == 0
    assert kv.allocate_slots(first, 15, hits, 0) == list(range(1, 13))
    tables = kv.group_tables("0")
    assert [_ids(t) for t in tables] == [[1, 4, 7, 10], [2, 5, 8, 11], [3, 6, 9, 12]]
    for g, table in enumerate(tables):
        assert [b.block_hash for b in table[:3]] == [_key(kv, first, i, g) for i in range(3)]
        assert table[3].block_hash is None  # the partial block
        assert all(b.ref_cnt == 1 for b in table)
    first.num_computed_tokens = 15

    second = _request("1", common + [3] * 2)
    hits, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 3 * bs
    assert [_ids(t) for t in hits.tables] == [[1, 4, 7], [0, 5, 8], [0, 6, 9]]
    assert kv.allocate_slots(second, 2, hits, num_cached) == [13, 14, 15]
    assert all(b.ref_cnt == 2 for t in hits.tables for b in t if b.block_id)
    kv.free(first)
    kv.free(second)

    cached = kv.block_pool.cached
    cases = [
        ([(0, 1), (0, 2)], 3),  # out of every sliding window: no loss
        ([(0, 0)], 0),  # the full group's first block
        ([(2, 0), (2, 1), (2, 2)], 2),
        ([(2, 0)], 2),
        ([(2, 1)], 2),
        ([(2, 2)], 2),
        ([(2, 0), (0, 1), (0, 2)], 0),  # full serves 2, sliding serves 3 or 1: none agree
    ]
    for hidden, expect in cases:
        req = _request("x", common + [3] * 3)
        saved = {_key(kv, req, i, g): cached.pop(_key(kv, req, i, g)) for i, g in hidden}
        hits, num_cached = kv.get_computed_blocks(req)
        assert num_cached == expect * bs == _brute_force_hit(kv, req), hidden
        assert all(len(t) == expect for t in (hits.tables if hits else ()))
        cached.update(saved)


def test_freed_blocks_are_reused_unhashed_first_then_each_chain_tail_first():
    """vLLM test_prefill (free-queue order): after two requests sharing a
    prefix finish, their partial (hash-less) blocks come back first, then the
    never-used blocks, then the cached ones with every group's chain tail
    before its head; a request taking the whole pool gets them in that order."""
    bs = 4
    kv = HybridKVCacheManager(21, bs, (0, 2 * bs))
    common = [i for i in range(3) for _ in range(bs)]
    a, b = _request("a", common + [3] * 3), _request("b", common + [3] * 2)
    _compute(kv, a)
    _compute(kv, b)
    tables = [kv.group_tables("a"), kv.group_tables("b")]
    kv.free(a)
    kv.free(b)
    queue = list(kv.block_pool.free_queue)
    partial = {t[g][3].block_id for t in tables for g in range(2)}
    never_used = kv.block_pool.num_usable - 2 * 4 - 2  # a: 4 blocks a group, b: 1 more
    assert {blk.block_id for blk in queue[:4]} == partial
    assert all(blk.block_hash is None for blk in queue[: 4 + never_used])
    assert all(blk.block_hash is not None for blk in queue[4 + never_used :])
    full, sliding = tables[0]
    order = [queue.index(blk) for blk in full[:3]]
    assert order == sorted(order, reverse=True)  # the chain's tail is evicted first
    # The sliding block b's window never read was freed with a: evicted first.
    assert queue.index(sliding[0]) < min(queue.index(blk) for blk in sliding[1:3])
    taker = _request("t", [99] * (bs * 20))
    assert kv.allocate_slots(taker, bs * 10) == [blk.block_id for blk in queue]


def test_random_evictions_leave_the_hit_every_group_can_serve():
    """vLLM _test_partial_request_hit, over random hidden blocks and models
    with one to three groups (windows of one block, several, and two groups
    of the same window): the hit equals the brute force, every group's hit
    table has the hit's length, holds the null block exactly where the
    group's window cannot see, and elsewhere the block cached under that
    group's key."""
    rng = random.Random(3)
    bs = 4
    for trial in range(40):
        windows = rng.choice([(0, 2 * bs), (0, bs + 1), (3 * bs,), (0, 2 * bs, 2 * bs), (0, 5, 13)])
        kv = HybridKVCacheManager(80, bs, windows)
        prompt = [rng.randrange(40) for _ in range(6 * bs + 2)]
        _compute(kv, _request("src", prompt))
        kv.free(_request("src", prompt))
        req = _request("q", prompt[: rng.randint(bs + 1, len(prompt))])
        cached = kv.block_pool.cached
        num_full = len(kv.hasher.update(req))
        keys = [_key(kv, req, i, g) for i in range(num_full) for g in range(len(windows))]
        saved = {
            k: cached.pop(k)
            for k in rng.sample(keys, min(len(keys), rng.randint(0, 4)))
            if k in cached
        }
        hits, num_cached = kv.get_computed_blocks(req)
        assert num_cached == _brute_force_hit(kv, req), (trial, windows)
        k = num_cached // bs
        for g, (w, table) in enumerate(zip(windows, hits.tables if hits else ())):
            assert len(table) == k
            skip = 0 if w == 0 else max(0, (k * bs - w + 1) // bs)
            assert all(b is kv.block_pool.null_block for b in table[:skip])
            assert [b.block_hash for b in table[skip:]] == [
                _key(kv, req, i, g) for i in range(skip, k)
            ]
        cached.update(saved)


# -- test_kv_cache_utils.py ---------------------------------------------------------
def test_a_sliding_group_never_holds_more_than_its_sizing_bound():
    """vLLM's SlidingWindowSpec.max_memory_usage_bytes (test_kv_cache_utils,
    per-group sizing): a sliding group of window W holds at most
    ceil((W - 1 + chunk) / block) + 1 blocks of a request prefilled in
    ``chunk``-token steps, a full group a block per block_size tokens; that is
    what worker/kv_groups.py's blocks_per_seq sizes the cache by, and a
    request running to its full length reaches it."""
    from tokenbudget.worker.kv_groups import blocks_per_seq

    bs = 4
    for window, chunk, length in [(10, 1, 64), (10, 8, 64), (9, 6, 70), (4, 3, 50), (16, 16, 96)]:
        kv = HybridKVCacheManager(200, bs, (0, window))
        req = _request("r", list(range(length)))
        peak = [0, 0]
        while req.num_computed_tokens < length:
            n = min(chunk, length - req.num_computed_tokens)
            assert kv.allocate_slots(req, n) is not None
            req.num_computed_tokens += n
            peak = [max(p, kv.num_held_blocks("r", g)) for g, p in enumerate(peak)]
        bound = -(-(window - 1 + chunk) // bs) + 1
        assert peak[1] <= bound, (window, chunk)
        assert peak[0] == -(-length // bs)
        runner = SimpleNamespace(kv_layout=SimpleNamespace(windows=(0, window)))
        config = SimpleNamespace(
            max_model_len=length - 1, num_speculative_tokens=0, max_num_batched_tokens=chunk
        )
        assert blocks_per_seq(runner, config, bs) == peak[0] + min(peak[0], bound)
        if chunk == 1:
            assert peak[1] == bound  # decoding reaches the bound
