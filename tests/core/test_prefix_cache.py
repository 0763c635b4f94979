"""Prefix caching: full blocks are found again by their chained hash, salts and
images change the hash, and freed blocks are evicted LRU, chain tail first."""

from __future__ import annotations

from tokenbudget.core.kv import BlockPool


def _prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_second_request_reuses_three_cached_blocks_of_a_finished_one(
    make_scheduler, make_request, step, run_to_completion
):
    s = make_scheduler(block_size=16)
    s.add_request(make_request("first", _prompt(50), max_tokens=2))
    first_so, _ = step(s)
    first_blocks = first_so.scheduled_new_reqs[0].block_ids
    run_to_completion(s)

    s.add_request(make_request("second", _prompt(48) + [900, 901, 902], max_tokens=2))
    so, _ = step(s)

    second = s.requests["second"]
    new = so.scheduled_new_reqs[0]
    assert second.num_cached_tokens == 48
    assert new.num_computed_tokens == 48
    assert new.block_ids[:3] == first_blocks[:3]
    assert so.num_scheduled_tokens == {"second": 3}
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (50 + 51, 48)


def test_prompt_fully_in_cache_still_recomputes_its_last_token(
    make_scheduler, make_request, step, run_to_completion
):
    s = make_scheduler(block_size=16)
    s.add_request(make_request("first", _prompt(48), max_tokens=2))
    run_to_completion(s)

    # 48 tokens = 3 full cached blocks, but the last token must produce logits:
    # only whole blocks strictly before it can be hits.
    s.add_request(make_request("same", _prompt(48), max_tokens=2))
    so, outs = step(s)
    assert s.requests["same"].num_cached_tokens == 32
    assert so.num_scheduled_tokens == {"same": 16}
    assert [o.request_id for o in outs] == ["same"]

    s.add_request(make_request("plus_one", _prompt(49), max_tokens=2))
    so, _ = step(s)
    assert s.requests["plus_one"].num_cached_tokens == 48
    assert so.num_scheduled_tokens["plus_one"] == 1


def test_different_cache_salt_gets_no_hit(make_scheduler, make_request, step, run_to_completion):
    s = make_scheduler(block_size=16)
    s.add_request(make_request("first", _prompt(50), max_tokens=1, salt="alice"))
    run_to_completion(s)

    reqs = [
        make_request("other_salt", _prompt(50), max_tokens=1, salt="bob"),
        make_request("no_salt", _prompt(50), max_tokens=1),
        make_request("same_salt", _prompt(50), max_tokens=1, salt="alice"),
    ]
    for r in reqs:
        s.add_request(r)
    step(s)

    cached = {r.request_id: r.num_cached_tokens for r in reqs}
    assert cached == {"other_salt": 0, "no_salt": 0, "same_salt": 48}


def test_different_image_gets_no_hit_on_blocks_overlapping_it(
    make_scheduler, make_request, step, run_to_completion
):
    s = make_scheduler(block_size=16)
    # The image's placeholder tokens [20, 36) overlap blocks 1 and 2.
    s.add_request(make_request("cat", _prompt(50), max_tokens=1, mm=[("cat", 20, 16)]))
    run_to_completion(s)

    dog = make_request("dog", _prompt(50), max_tokens=1, mm=[("dog", 20, 16)])
    cat_again = make_request("cat_again", _prompt(50), max_tokens=1, mm=[("cat", 20, 16)])
    s.add_request(dog)
    s.add_request(cat_again)
    step(s)

    assert dog.num_cached_tokens == 16
    assert cat_again.num_cached_tokens == 48


def test_freed_blocks_are_evicted_lru_first_and_chain_tail_before_head(
    make_scheduler, make_request, step, run_to_completion
):
    s = make_scheduler(block_size=16, num_blocks=5)  # usable blocks 1..4
    s.add_request(make_request("chain", _prompt(40), max_tokens=1))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    run_to_completion(s)
    pool = s.kv_cache_manager.block_pool
    # Freed tail first: the partial (hash-less) block 3 goes to the head, ahead
    # of the never-used 4; then the cached 2 and the chain head 1, LRU order.
    assert [b.block_id for b in pool.free_queue] == [3, 4, 2, 1]

    s.add_request(make_request("other", _prompt(17, start=500), max_tokens=1))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].block_ids == [3, 4]  # the unhashed ones go first
    run_to_completion(s)
    # "other"'s partial block 4 is hash-less (head), its full block 3 cached (tail).
    assert [b.block_id for b in pool.free_queue] == [4, 2, 1, 3]

    s.add_request(make_request("third", _prompt(20, start=700), max_tokens=1))
    so, _ = step(s)
    # The hash-less 4 first, then the least recently freed cached block, 2: the
    # tail of "chain" is evicted, its head stays.
    assert so.scheduled_new_reqs[0].block_ids == [4, 2]
    run_to_completion(s)

    again = make_request("chain_again", _prompt(40), max_tokens=1)
    s.add_request(again)
    so, _ = step(s)
    assert again.num_cached_tokens == 16
    assert so.scheduled_new_reqs[0].block_ids[0] == 1


def test_block_pool_revives_a_cached_free_block_and_evicts_on_reuse():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free_blocks([b, a, c])
    assert [x.block_id for x in pool.free_queue] == [3, 2, 1]  # hash-less c at the head

    pool.touch([pool.get_cached_block(b"ha")])  # a prefix hit takes it out of the queue
    assert a.ref_cnt == 1 and [x.block_id for x in pool.free_queue] == [3, 2]
    (first,) = pool.get_new_blocks(1)
    assert first is c and pool.get_cached_block(b"hb") is b  # nothing evicted for c
    (second,) = pool.get_new_blocks(1)
    assert second is b and pool.get_cached_block(b"hb") is None and b.block_hash is None
    pool.check_invariants()


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(
    make_scheduler, make_request, step, run_to_completion
):
    s = make_scheduler(block_size=16)
    s.add_request(make_request("a", _prompt(40), max_tokens=3))
    step(s)
    assert s.reset_prefix_cache() is False
    run_to_completion(s)
    assert s.reset_prefix_cache() is True

    b = make_request("b", _prompt(40), max_tokens=1)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 0


def test_prefix_caching_off_never_hits(make_scheduler, make_request, step, run_to_completion):
    s = make_scheduler(block_size=16, enable_prefix_caching=False)
    s.add_request(make_request("a", _prompt(40), max_tokens=1))
    run_to_completion(s)
    b = make_request("b", _prompt(40), max_tokens=1)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 0


def test_freed_blocks_without_a_hash_are_reused_before_any_cached_block(make_request):
    """vLLM's order: a freed partial (hash-less) block goes to the head of the free
    queue, so the next allocation takes it instead of evicting a cached block."""
    from tokenbudget.core.kv import KVCacheManager

    kv = KVCacheManager(num_blocks=7, block_size=4)  # 6 usable blocks
    x = make_request("x", list(range(1, 9)))  # 2 full blocks
    y = make_request("y", list(range(50, 64)))  # 3 full blocks + a partial one
    for req in (x, y):
        kv.hasher.update(req)
        assert kv.allocate_slots(req, req.num_tokens) is not None
    partial = kv.req_to_blocks["y"][-1]
    assert partial.block_hash is None and len(kv.block_pool.cached) == 5
    kv.free(x)
    kv.free(y)
    kv.block_pool.check_invariants()
    z = make_request("z", [900])
    [got] = kv.allocate_slots(z, 1)
    assert got == partial.block_id
    assert len(kv.block_pool.cached) == 5  # every cached block can still be hit


def test_no_prefix_cache_query_is_counted_with_caching_off_or_for_a_request_that_skips_it(
    make_scheduler, make_request, run_to_completion
):
    off = make_scheduler(block_size=16, enable_prefix_caching=False)
    off.add_request(make_request("a", _prompt(40), max_tokens=2))
    run_to_completion(off)
    assert (off.make_stats().prefix_cache_queries, off.make_stats().prefix_cache_hits) == (0, 0)

    on = make_scheduler(block_size=16)
    on.add_request(make_request("lp", _prompt(40), max_tokens=2, prompt_logprobs=1))
    run_to_completion(on)
    assert on.make_stats().prefix_cache_queries == 0  # it never reads the cache
    on.add_request(make_request("b", _prompt(40), max_tokens=2))
    run_to_completion(on)
    assert (on.make_stats().prefix_cache_queries, on.make_stats().prefix_cache_hits) == (40, 32)
