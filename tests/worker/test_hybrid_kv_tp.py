"""KV cache groups under tensor parallelism: LLM(tensor_parallel_size=2) on
two real rank processes (gloo on CPU) runs a model with a full-attention and
a sliding-window group (tiny Gemma-2: alternating layers, attention and
final-logit soft-capping; each rank holds one of its two KV heads) and gives the
greedy tokens of transformers generate(), with prompts several windows long,
chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import numpy as np
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.core.kv.groups import HybridKVCacheManager
from tokenbudget.server import LLM
from tokenbudget.server.testing.tiny_models import QWEN_SPECIAL_TOKENS

BS = 8
WINDOW = 20
NEW = 8
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
)


def _build_gemma2(path) -> str:
    import transformers

    from tokenbudget.server.testing.tiny_models import build_tokenizer, padded_vocab_size

    tokenizer = build_tokenizer(path)
    config = transformers.Gemma2Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,  # small caps so soft-capping changes the scores
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=16,
        **COMMON,
    )
    torch.manual_seed(6)
    model = transformers.Gemma2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(str(path))
    return str(path)


def _expected(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def test_tp2_with_kv_groups_gives_transformers_greedy_tokens(tmp_path):
    path = _build_gemma2(tmp_path / "gemma2")
    rng = np.random.default_rng(9)
    shared = rng.integers(len(QWEN_SPECIAL_TOKENS), 500, size=3 * WINDOW + 5).tolist()
    first = [rng.integers(len(QWEN_SPECIAL_TOKENS), 500, size=n).tolist() for n in (70, 2 * WINDOW)]
    second = [shared + rng.integers(len(QWEN_SPECIAL_TOKENS), 500, size=n).tolist() for n in (9, 4)]
    expected = _expected(path, [shared, *first, *second])
    # 24-token steps chunk the prompts; 30 blocks cannot hold all three
    # requests in both groups at once, so some are preempted and recomputed.
    llm = LLM(
        path,
        tensor_parallel_size=2,
        dtype="float32",
        device="cpu",
        block_size=BS,
        num_gpu_blocks=30,
        max_num_batched_tokens=24,
        max_model_len=96,
    )
    try:
        kv = llm.engine.scheduler.kv_cache_manager
        assert isinstance(kv, HybridKVCacheManager) and kv.windows == (0, WINDOW)
        params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in [shared, *first]], params)
        hit = llm.generate([{"prompt_token_ids": p} for p in second], params)
        assert [o.token_ids for o in got + hit] == expected
        # The first may find the shared blocks evicted (a small pool); it caches them again.
        assert max(o.num_cached_tokens for o in hit) >= 4 * BS
        assert llm.engine.scheduler.num_preemptions > 0
        kv.block_pool.check_invariants()
    finally:
        llm.shutdown()
