"""The host KV tier with KV cache groups, through LLM on tiny Gemma-2 (full and
sliding layers, soft-capping) and Mistral with a window: requests swapped out
and back in recompute nothing, prefix blocks evicted to the host come back
as host hits, and greedy tokens equal transformers generate() throughout;
afterwards every device block and host slot is free."""

from __future__ import annotations

import pytest

from tokenbudget.core import SamplingParams
from tokenbudget.core.kv.events import HOST, KVEventReplayer
from tokenbudget.core.kv.groups import HybridKVCacheManager

from .test_hybrid_kv import BS, NEW, WINDOW, _build, _expected, _prompts


# Gemma-2: two groups, one full; Mistral: one sliding group, a few blocks a request.
BLOCKS = {"gemma2": 26, "mistral": 13}


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_swaps_and_host_hits_with_groups_equal_transformers(tmp_path, arch):
    from tokenbudget.server import LLM

    path = _build(tmp_path, arch)
    shared = _prompts(1, [3 * WINDOW + 5], seed=7)[0]  # several windows long
    crowd = _prompts(4, [70, 45, 2 * WINDOW + 3, 60])
    later = [shared + [21, 22, 23]]
    expected = _expected(path, [shared, *crowd, *later], NEW)
    # The pool holds about two requests in every group: the crowd preempts;
    # the host tier takes the victims' KV and the evicted shared prefix.
    blocks = BLOCKS[arch]
    llm = LLM(
        path,
        max_num_batched_tokens=24,
        num_gpu_blocks=blocks,
        num_offload_blocks=200,
        block_size=BS,
        max_model_len=96,
        attention_backend="cpu",
        async_scheduling=False,
        enable_kv_cache_events=True,
    )
    scheduler = llm.engine.scheduler
    tiering = scheduler.kv_tiering
    assert isinstance(scheduler.kv_cache_manager, HybridKVCacheManager)
    sub = tiering.events.subscribe()
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in [shared, *crowd]], params)
    stats = scheduler.make_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_swap_out_blocks > 0 and stats.kv_swap_in_blocks > 0
    assert stats.num_recomputed_tokens == 0
    hit = llm.generate([{"prompt_token_ids": p} for p in later], params)
    assert [o.token_ids for o in got + hit] == expected
    assert tiering.num_host_hit_tokens > 0
    assert hit[0].num_cached_tokens >= 4 * BS
    # Host-tier events name each block's group.
    replayer = KVEventReplayer()
    while (batch := sub.get(timeout=0)) is not None:
        replayer.apply(batch)
    groups = scheduler.kv_cache_manager.windows
    assert all(replayer.groups[g][HOST] for g in range(len(groups)))
    tiering.check_invariants()
    pool = scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_usable
    assert tiering.host.get_num_free_blocks() == tiering.host.num_usable and not tiering.swapped
    llm.shutdown()


@pytest.mark.parametrize(
    "arch, async_scheduling", [("gemma2", False), ("mistral", False), ("gemma2", True)]
)
def test_without_prefix_caching_every_resume_is_a_swap_in(tmp_path, arch, async_scheduling):
    # No device hit can stand in for the swap: each victim's KV comes back
    # from the host, out-of-window blocks excluded.
    from tokenbudget.server import LLM

    path = _build(tmp_path, arch)
    prompts = _prompts(4, [70, 45, 2 * WINDOW + 3, 60], seed=9)
    expected = _expected(path, prompts, 2 * NEW)
    llm = LLM(
        path,
        max_num_batched_tokens=24,
        num_gpu_blocks=BLOCKS[arch],
        num_offload_blocks=200,
        block_size=BS,
        max_model_len=96,
        attention_backend="cpu",
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(max_tokens=2 * NEW, temperature=0, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.token_ids for o in got] == expected
    stats = llm.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens == 0
    assert stats.kv_swap_in_blocks >= stats.num_preemptions
    llm.engine.scheduler.kv_tiering.check_invariants()
    llm.shutdown()
