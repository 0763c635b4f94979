"""Gemma-3 text (five sliding-window layers to one full one in the real
checkpoints; here 3:1) on KV cache groups: greedy tokens equal transformers
under chunked prefill, prefix hits and preemption, with prompts several
windows long (issue 30)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_hybrid_kv import BS, COMMON, NEW, WINDOW, _expected, _prompts
from tokenbudget.core import SamplingParams
from tokenbudget.core.kv.groups import HybridKVCacheManager
from tokenbudget.server import LLM

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma3ForCausalLM"):
    pytest.skip("this transformers has no Gemma-3", allow_module_level=True)


def _build_gemma3(tmp_path) -> str:
    from tokenbudget.server.testing.tiny_models import build_tokenizer, padded_vocab_size

    path = tmp_path / "gemma3"
    tokenizer = build_tokenizer(path)
    config = transformers.Gemma3TextConfig(
        vocab_size=padded_vocab_size(len(tokenizer)),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        **COMMON,
    )
    torch.manual_seed(2)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(str(path))
    return str(path)


def test_gemma3_text_equals_transformers_with_chunks_prefix_hits_and_preemption(tmp_path):
    path = _build_gemma3(tmp_path)
    shared = _prompts(1, [3 * WINDOW + 5], seed=7)[0]
    first = _prompts(3, [70, 45, 2 * WINDOW + 3])
    second = _prompts(2, [6, 13], seed=5, prefix=shared)
    expected = _expected(path, [shared, *first, *second], NEW)
    llm = LLM(path, max_num_batched_tokens=24, num_gpu_blocks=40, block_size=BS, max_model_len=96)
    kv = llm.engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert llm.engine.cache_config.kv_group_windows == (0, WINDOW)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = [
        o.token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in [shared, *first]], params)
    ]
    hits = llm.generate([{"prompt_token_ids": p} for p in second], params)
    assert got + [o.token_ids for o in hits] == expected
    assert max(o.num_cached_tokens for o in hits) >= 4 * BS, [o.num_cached_tokens for o in hits]
    assert llm.engine.scheduler.num_preemptions > 0
    kv.block_pool.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable
    llm.shutdown()
