"""The host KV tier through LLM on the tiny Qwen3 (float32, CPU): greedy tokens
equal transformers generate() under heavy preemption with nothing recomputed,
and a prefix evicted to the host comes back as exactly the KV it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core import Request, SamplingParams
from tokenbudget.core.kv.events import DEVICE, HOST, KVEventReplayer
from tokenbudget.server import LLM


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("async_scheduling", False)
    return LLM(path, dtype="float32", device="cpu", **kwargs)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def crowded(hf_greedy):
    """Four 60-token prompts growing to 100 tokens in 20 blocks of 16: they are
    all admitted, but growing needs 28 blocks, so requests are preempted."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 1000, size=60).tolist() for _ in range(4)]
    return prompts, [hf_greedy(p, 40) for p in prompts]


GREEDY_40 = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


# Without prefix caching only the swap can spare the recompute (with it, blocks
# freed at preemption may also come back as device or host prefix hits).
@pytest.mark.parametrize(
    "async_scheduling,caching",
    [(False, True), (False, False), (True, True)],
    ids=["sync", "sync-no-prefix-cache", "async"],
)
def test_swapped_requests_recompute_nothing_and_match_transformers(
    tiny_qwen3_path, crowded, async_scheduling, caching
):
    prompts, expected = crowded
    llm = make_llm(
        tiny_qwen3_path,
        num_gpu_blocks=20,
        num_offload_blocks=64,
        async_scheduling=async_scheduling,
        enable_prefix_caching=caching,
    )
    results = llm.generate(token_prompts(prompts), GREEDY_40)
    stats = llm.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0
    assert stats.num_recomputed_tokens == 0
    assert stats.kv_swap_out_blocks > 0 and stats.kv_swap_in_blocks > 0
    assert [r.token_ids for r in results] == expected
    assert stats.num_offload_blocks == 64 and stats.num_swapped_requests == 0
    llm.engine.scheduler.kv_tiering.check_invariants()


def test_without_room_preemption_recomputes_and_still_matches(tiny_qwen3_path, crowded):
    prompts, expected = crowded
    llm = make_llm(tiny_qwen3_path, num_gpu_blocks=20, num_offload_blocks=2)
    results = llm.generate(token_prompts(prompts), GREEDY_40)
    stats = llm.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0
    assert [r.token_ids for r in results] == expected


def _block_kv(llm: LLM, block_id: int) -> torch.Tensor:
    """[layers, 2, block_size, kv_heads, head_dim] of one device block."""
    caches = llm.executor.worker.model_runner.kv_caches
    return torch.stack([c[:, block_id] for c in caches]).clone()


def test_a_host_hit_restores_exactly_the_evicted_kv(tiny_qwen3_path, hf_greedy):
    rng = np.random.default_rng(2)
    shared = rng.integers(10, 1000, size=65).tolist()  # 4 full blocks + 1
    other = rng.integers(10, 1000, size=170).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm = make_llm(
        tiny_qwen3_path, num_gpu_blocks=12, num_offload_blocks=32, enable_kv_cache_events=True
    )
    events = llm.subscribe_kv_events()
    scheduler = llm.engine.scheduler
    device = scheduler.kv_cache_manager.block_pool.cached
    host = scheduler.kv_tiering.host.cached
    probe = Request("probe", shared, SamplingParams())
    hashes = scheduler.kv_cache_manager.hasher.update(probe)[:4]

    llm.generate(token_prompts([shared]), one)
    computed = [_block_kv(llm, device[h].block_id) for h in hashes]
    llm.generate(token_prompts([other]), one)  # needs all 11 blocks
    assert not any(h in device for h in hashes), "the shared prefix was evicted"
    host_kv = llm.executor.worker.model_runner.host_kv.tensor
    for h, kv in zip(hashes, computed):
        assert torch.equal(host_kv[:, :, host[h].block_id], kv), "spilled KV differs"

    again = llm.generate(token_prompts([shared]), GREEDY_40)[0]
    assert again.num_cached_tokens == 64
    for h, kv in zip(hashes, computed):
        assert torch.equal(_block_kv(llm, device[h].block_id), kv), "loaded KV differs"
    assert again.token_ids == hf_greedy(shared, 40)
    roomy = make_llm(tiny_qwen3_path, num_gpu_blocks=64)
    assert roomy.generate(token_prompts([shared]), GREEDY_40)[0].token_ids == again.token_ids
    scheduler.kv_tiering.check_invariants()
    replayer = KVEventReplayer()
    while (batch := events.get(timeout=0)) is not None:
        replayer.apply(batch)
    assert replayer.tiers == {DEVICE: set(device), HOST: set(host)}
    with pytest.raises(ValueError, match="enable_kv_cache_events"):
        roomy.subscribe_kv_events()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swap_with_speculative_decoding_matches_transformers(
    tiny_qwen3_path, crowded, async_scheduling
):
    """Draft positions computed before a preemption are not restored as if
    verified: the resumed request recomputes only from its last known token."""
    prompts, expected = crowded
    llm = make_llm(
        tiny_qwen3_path,
        num_gpu_blocks=20,
        num_offload_blocks=64,
        async_scheduling=async_scheduling,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    results = llm.generate(token_prompts(prompts), GREEDY_40)
    stats = llm.engine.scheduler.make_stats()
    assert stats.spec_decoding.num_drafts > 0
    assert stats.num_preemptions > 0 and stats.kv_swap_in_blocks > 0
    assert stats.num_recomputed_tokens == 0
    assert [r.token_ids for r in results] == expected


def test_tensor_parallel_ranks_each_swap_their_shard_of_the_kv(tiny_qwen3_path, crowded):
    """Every rank runs the step's copies on its own KV heads: had one skipped
    or misplaced them, its half of the attention would read other KV."""
    prompts, expected = crowded
    llm = make_llm(
        tiny_qwen3_path,
        tensor_parallel_size=2,
        num_gpu_blocks=20,
        num_offload_blocks=64,
        enable_prefix_caching=False,
    )
    try:
        results = llm.generate(token_prompts(prompts), GREEDY_40)
        stats = llm.engine.scheduler.make_stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0 and stats.kv_swap_in_blocks > 0
    assert stats.num_recomputed_tokens == 0
    assert [r.token_ids for r in results] == expected
