"""KV cache sizing on CPU: kv_cache_memory (``--kv-cache-memory``) buys
exactly as many blocks as fit, computed here from the checkpoint's config."""
from __future__ import annotations

import pytest
from transformers import AutoConfig

from tokenbudget.core import CacheConfig, SchedulerConfig
from tokenbudget.server import LLM
from tokenbudget.worker.model_runner import ModelRunner


def _bytes_per_block(path: str, block_size: int) -> int:
    """K and V, every layer, float32: from the config, not from our code."""
    cfg = AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


def test_kv_cache_memory_sets_the_number_of_blocks(tiny_qwen3_path):
    per_block = _bytes_per_block(tiny_qwen3_path, 16)
    llm = LLM(tiny_qwen3_path, dtype="float32", device="cpu", kv_cache_memory="1MiB",
              async_scheduling=False)
    try:
        assert llm.cache_config.num_blocks == (1 << 20) // per_block
        pool = llm.engine.scheduler.kv_cache_manager.block_pool
        assert pool.num_blocks == llm.cache_config.num_blocks
        caches = llm.engine.executor.worker.model_runner.kv_caches
        assert sum(c.numel() * c.element_size() for c in caches) == \
            llm.cache_config.num_blocks * per_block <= 1 << 20
    finally:
        llm.shutdown()


def test_cpu_default_is_what_max_num_seqs_requests_at_max_model_len_need(tiny_qwen3_path):
    runner = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu")
    sched = SchedulerConfig(max_num_seqs=3, max_model_len=100)
    # Blocks for max_model_len + 1 tokens per sequence, plus the null block.
    assert runner.initialize_kv_cache(CacheConfig(block_size=16), sched) == 3 * 7 + 1


def test_a_kv_cache_memory_too_small_for_two_blocks_is_refused(tiny_qwen3_path):
    runner = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu")
    per_block = _bytes_per_block(tiny_qwen3_path, 16)
    with pytest.raises(ValueError, match="KV cache too small"):
        runner.initialize_kv_cache(CacheConfig(kv_cache_memory_bytes=2 * per_block - 1),
                                   SchedulerConfig())
    # Today the floor is two blocks (the null block and one more); a cache that
    # cannot hold one max_model_len request is not refused yet (issue 16).
    assert runner.initialize_kv_cache(CacheConfig(kv_cache_memory_bytes=2 * per_block),
                                      SchedulerConfig(max_model_len=4096)) == 2
