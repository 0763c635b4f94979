"""Chunked local attention (Llama 4's ``attention_chunk_size``: a query at
position p sees the keys from ``p // C * C`` to p) runs exactly on a KV cache
group of its own (core/kv/groups.py, worker/kv_groups.py): greedy tokens of a
tiny Llama 4 text model (chunked layers with RoPE and qk-norm, a full NoPE
layer with attention temperature tuning, MoE layers) equal transformers'
generate() with prompts several chunks long, chunked prefill, prefix hits,
preemption and async scheduling, on the sdpa and cpu backends; a long request
holds a chunk's worth of blocks in the chunked group at every step."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.core.kv.groups import HybridKVCacheManager, chunked
from tokenbudget.server import LLM

from .test_hybrid_kv import _expected, _prompts

BS = 8
CHUNK = 12  # not a multiple of the block size: chunks start inside blocks
NEW = 10


def _build_llama4(path, chunk: int, **overrides) -> str:
    import transformers

    from tokenbudget.server.testing.tiny_models import build_tokenizer, padded_vocab_size

    tokenizer = build_tokenizer(path)
    config = transformers.Llama4TextConfig(
        vocab_size=padded_vocab_size(len(tokenizer)),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,  # layers 1 and 3 are MoE
        attention_chunk_size=chunk,  # layers 0-2 chunked (RoPE), layer 3 full (NoPE)
        # The NoPE layer's query temperature grows with its position every 4
        # tokens (8192 in Llama 4), strongly enough to change greedy tokens.
        floor_scale=4,
        attn_scale=4.0,
        max_position_embeddings=1024,
        **overrides,
    )
    torch.manual_seed(2)
    model = transformers.Llama4ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> str:
    return _build_llama4(tmp_path_factory.mktemp("llama4"), CHUNK)


@pytest.fixture(scope="module")
def workload(llama4):
    shared = _prompts(1, [4 * CHUNK + 5], seed=7)[0]  # several chunks long
    first = _prompts(3, [70, 45, 2 * CHUNK + 3])
    second = _prompts(2, [6, 13], seed=5, prefix=shared)  # prefix hits on the shared part
    return shared, first, second, _expected(llama4, [shared, *first, *second], NEW)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
def test_greedy_equals_transformers_with_chunks_prefix_hits_and_preemption(
    llama4, workload, backend, async_scheduling
):
    shared, first, second, expected = workload
    # 24-token steps cut the prompts across chunk boundaries; the pool cannot
    # hold every request at once, so some are preempted and recomputed.
    llm = LLM(
        llama4,
        max_num_batched_tokens=24,
        num_gpu_blocks=30,
        block_size=BS,
        max_model_len=96,
        attention_backend=backend,
        async_scheduling=async_scheduling,
    )
    assert llm.engine.cache_config.kv_group_windows == (0, chunked(CHUNK))
    assert llm.engine.executor.worker.model_runner.attention_backend == backend
    kv = llm.engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
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


def test_long_request_holds_a_chunk_of_blocks_in_the_chunked_group(tmp_path):
    chunk, bs = 16, 4
    path = _build_llama4(tmp_path / "llama4", chunk)
    prompt = _prompts(1, [2 * chunk])[0]
    max_new = 10 * chunk
    expected = _expected(path, [prompt], max_new)
    # The pool holds max_model_len in both groups (the admission rule counts them in full).
    llm = LLM(path, max_num_batched_tokens=bs, num_gpu_blocks=129, block_size=bs, max_model_len=256)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.windows == (0, chunked(chunk))
    held: list[int] = []
    allocate = kv.allocate_slots

    def recording(request, *args, **kwargs):
        out = allocate(request, *args, **kwargs)
        held.append(kv.num_held_blocks(request.request_id, 1))
        return out

    kv.allocate_slots = recording
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True),
    )[0]
    assert out.token_ids == expected[0]
    assert len(held) >= max_new and max(held) <= -(-chunk // bs) + 2, max(held)
    llm.shutdown()


def test_a_model_of_chunked_layers_only_skips_whole_chunks_it_never_reads(tmp_path):
    # Every layer chunked: a query at a chunk's start reads no earlier KV at
    # all, so a prompt's earlier chunks count as cached without any cached
    # block (a prefix hit needs only the blocks of the chunk it resumes in).
    path = _build_llama4(tmp_path / "local", CHUNK, layer_types=["chunked_attention"] * 4)
    prompts = _prompts(2, [3 * CHUNK + 5, 2 * CHUNK], seed=9)
    expected = _expected(path, prompts, NEW)
    llm = LLM(path, max_num_batched_tokens=24, num_gpu_blocks=40, block_size=BS, max_model_len=96)
    assert llm.engine.cache_config.kv_group_windows == (chunked(CHUNK),)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.token_ids for o in outs] == expected
    # The longest k <= (41 - 1) // 8 blocks whose position k * 8 starts a chunk: 24.
    assert [o.num_cached_tokens for o in outs] == [24, 0]
    llm.shutdown()
