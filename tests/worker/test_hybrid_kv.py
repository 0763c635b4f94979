"""Models whose layers attend differently run exactly on KV cache groups
(core/kv/groups.py, worker/kv_groups.py): greedy tokens equal transformers'
generate() for tiny Gemma-2 (attention and final-logit soft-capping,
alternating sliding / full layers), Mistral with a window narrower than the
prompt and Qwen2 with ``max_window_layers``, with prompts several windows
long, chunked prefill, prefix hits and preemption; and a long request on a
sliding-window-only model holds a window's worth of blocks at every step."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.core.kv.groups import HybridKVCacheManager
from tokenbudget.server import LLM
from tokenbudget.server.testing.tiny_models import QWEN_SPECIAL_TOKENS, build_tiny_decoder

BS = 8
WINDOW = 20
NEW = 10
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
)
MODELS = {
    # Large weights and small caps so soft-capping changes the tokens (with the
    # default 0.02 init it changes no logit); query_pre_attn_scalar = head_dim.
    "gemma2": dict(
        num_hidden_layers=4,
        sliding_window=WINDOW,
        initializer_range=0.2,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=16,
    ),
    "mistral": dict(num_hidden_layers=2, sliding_window=WINDOW),
    "qwen2": dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
}


def _build(tmp_path, arch: str) -> str:
    if arch == "gemma2":
        return _build_gemma2(tmp_path)
    return build_tiny_decoder(tmp_path / arch, arch, seed=2, **COMMON, **MODELS[arch])


def _build_gemma2(tmp_path) -> str:
    import transformers

    from tokenbudget.server.testing.tiny_models import build_tokenizer, padded_vocab_size

    path = tmp_path / "gemma2"
    tokenizer = build_tokenizer(path)
    config = transformers.Gemma2Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        **COMMON,
        **MODELS["gemma2"],
    )
    torch.manual_seed(2)
    model = transformers.Gemma2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(str(path))
    return str(path)


def _expected(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [
            hf.generate(
                torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def _prompts(n: int, lengths, seed: int = 3, prefix: list[int] | None = None):
    rng = np.random.default_rng(seed)
    return [
        (prefix or []) + rng.integers(len(QWEN_SPECIAL_TOKENS), 500, size=k).tolist()
        for k in lengths[:n]
    ]


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_greedy_equals_transformers_with_chunks_prefix_hits_and_preemption(tmp_path, arch, backend):
    path = _build(tmp_path, arch)
    shared = _prompts(1, [3 * WINDOW + 5], seed=7)[0]  # several windows long
    first = _prompts(3, [70, 45, 2 * WINDOW + 3])
    second = _prompts(2, [6, 13], seed=5, prefix=shared)  # prefix hits on the shared part
    expected = _expected(path, [shared, *first, *second], NEW)
    # 24-token steps chunk the prompts; the pool cannot hold every request at
    # once (in every group), so some are preempted and recomputed.
    blocks = 14 if arch == "mistral" else 40  # Mistral: one sliding group, a few blocks each
    llm = LLM(
        path,
        max_num_batched_tokens=24,
        num_gpu_blocks=blocks,
        block_size=BS,
        max_model_len=96,
        attention_backend=backend,  # both compute windows and soft-caps in place
    )
    kv = llm.engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = [
        o.token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in [shared, *first]], params)
    ]
    hits = llm.generate([{"prompt_token_ids": p} for p in second], params)
    assert got + [o.token_ids for o in hits] == expected
    # The first may find the shared blocks evicted (a small pool); it caches them again.
    assert max(o.num_cached_tokens for o in hits) >= 4 * BS, [o.num_cached_tokens for o in hits]
    assert llm.engine.scheduler.num_preemptions > 0
    kv.block_pool.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable
    llm.shutdown()


def test_long_request_on_a_sliding_model_holds_a_window_of_blocks(tmp_path):
    window, bs = 16, 4
    path = build_tiny_decoder(
        tmp_path / "mistral",
        "mistral",
        seed=4,
        **COMMON,
        num_hidden_layers=2,
        sliding_window=window,
    )
    prompt = _prompts(1, [2 * window])[0]
    max_new = 10 * window
    expected = _expected(path, [prompt], max_new)
    # The pool holds max_model_len (the admission rule counts every group in full).
    llm = LLM(path, max_num_batched_tokens=bs, num_gpu_blocks=129, block_size=bs, max_model_len=512)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.windows == (window,)
    held: list[int] = []
    allocate = kv.allocate_slots

    def recording(request, *args, **kwargs):
        out = allocate(request, *args, **kwargs)
        held.append(kv.num_held_blocks(request.request_id, 0))
        return out

    kv.allocate_slots = recording
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True),
    )[0]
    assert out.token_ids == expected[0]
    assert len(held) >= max_new and max(held) <= -(-window // bs) + 2, max(held)
    llm.shutdown()


def test_drafts_near_the_window_edge_keep_greedy_tokens(tmp_path):
    # n-gram drafts (a repetitive prompt) verified across the window's edge.
    path = _build(tmp_path, "gemma2")
    rng = np.random.default_rng(11)
    motif = rng.integers(len(QWEN_SPECIAL_TOKENS), 500, size=7).tolist()
    prompts = [motif * 5, (motif * 4)[3:]]
    expected = _expected(path, prompts, 2 * WINDOW)
    llm = LLM(
        path,
        max_num_batched_tokens=24,
        num_gpu_blocks=64,
        block_size=BS,
        max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=2 * WINDOW, temperature=0, ignore_eos=True),
    )
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.spec_decoding_stats.num_draft_tokens > 0
    llm.shutdown()


def test_a_block_costs_the_layers_of_one_group(tmp_path):
    # Gemma-2, 4 layers: 2 full + 2 sliding share 2 KV tensors.
    path = _build(tmp_path, "gemma2")
    per_block = 2 * 2 * BS * COMMON["num_key_value_heads"] * COMMON["head_dim"] * 4  # float32
    llm = LLM(path, kv_cache_memory=100 * per_block, block_size=BS, max_model_len=96)
    assert llm.engine.cache_config.num_blocks == 100
    assert llm.engine.cache_config.kv_group_windows == (0, WINDOW)
    llm.shutdown()


def test_a_remote_worker_reports_its_groups_and_runs_them(tmp_path):
    from tokenbudget.core import CacheConfig, Request, SchedulerConfig
    from tokenbudget.server.engine.core import EngineCore
    from tokenbudget.server.executor.remote import RemoteExecutor
    from tokenbudget.worker.grpc_worker import serve

    path = _build(tmp_path, "gemma2")
    prompts = _prompts(2, [3 * WINDOW, 2 * WINDOW + 5])
    expected = _expected(path, prompts, NEW)
    server, port, _ = serve("127.0.0.1", 0)
    try:
        executor = RemoteExecutor([f"127.0.0.1:{port}"], path, device="cpu")
        sched = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4, max_model_len=96)
        core = EngineCore(sched, CacheConfig(block_size=BS, num_blocks=40), executor)
        assert core.cache_config.kv_group_windows == (0, WINDOW)
        params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(Request(f"r{i}", p, params))
        out: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert [out["r0"], out["r1"]] == expected
        core.shutdown()
    finally:
        server.stop(0)


def test_getstats_reports_each_groups_window_and_blocks_in_use(tmp_path, serving):
    from tokenbudget.server.engine.async_engine import AsyncEngine
    from tokenbudget.server.engine.input_processor import InputProcessor

    path = _build(tmp_path, "qwen2")
    llm = LLM(path, max_num_batched_tokens=16, num_gpu_blocks=64, block_size=BS, max_model_len=128)
    engine = AsyncEngine(llm.engine, InputProcessor.from_pretrained(path), model_name="qwen2")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with serving(engine) as client:
        stream = client.generate_stream({"token_ids": _prompts(1, [3 * WINDOW])[0]}, params)
        for _, msg in zip(range(20), stream):  # well past the window: blocks given back
            assert not msg.finish_reason
        mid = client.stats()
        stream.close()
        for _ in range(100):
            idle = client.stats()
            if idle.num_running == 0:
                break
            time.sleep(0.05)
    assert [g.window for g in mid.kv_groups] == [0, WINDOW]
    full, sliding = (g.num_blocks_used for g in mid.kv_groups)
    # Every block in use is in one group; the window holds fewer than full attention.
    assert full + sliding == mid.num_total_blocks - mid.num_free_blocks
    assert full >= -(-(3 * WINDOW + 20) // BS) and 0 < sliding < full
    assert [(g.window, g.num_blocks_used) for g in idle.kv_groups] == [(0, 0), (WINDOW, 0)]


def test_kv_events_over_grpc_name_each_blocks_group(tmp_path, serving):
    from tokenbudget.core.kv.events import DEVICE, KVEventReplayer
    from tokenbudget.server.engine.async_engine import AsyncEngine
    from tokenbudget.server.engine.input_processor import InputProcessor

    path = _build(tmp_path, "qwen2")
    llm = LLM(
        path, num_gpu_blocks=64, block_size=BS, max_model_len=128, enable_kv_cache_events=True
    )
    engine = AsyncEngine(llm.engine, InputProcessor.from_pretrained(path), model_name="qwen2")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with serving(engine) as client:
        client.generate({"token_ids": _prompts(1, [3 * WINDOW])[0]}, params)
        stream = client.subscribe_kv_events()
        replayer = KVEventReplayer()
        replayer.apply(next(iter(stream)))  # the snapshot, as of now (nothing runs)
        stream.cancel()
    cached = llm.engine.scheduler.kv_cache_manager.block_pool.cached
    assert set(replayer.groups) == {0, 1}
    full, sliding = replayer.groups[0][DEVICE], replayer.groups[1][DEVICE]
    assert len(full) == (3 * WINDOW + 8 - 1) // BS  # every full block computed
    assert sliding and sliding <= full
    assert {h + b"\x01" for h in sliding} | full == set(cached)
