"""Prompt logprobs and n > 1 read every group's block table (issue 30): on a
tiny Gemma-2 (sliding + full layers, soft-capping) and a tiny Llama 4 (chunked
local + full layers), prompt logprobs equal transformers' log-softmax over the
prompt when the prompt prefills in chunks past where the window (chunk) drops
its blocks, with preemption and with the prompt already cached; n greedy
samples each equal transformers' greedy tokens, and n seeded samples each
equal their seed alone, under a pool small enough to preempt, after which
every block of every group is free."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.core.kv.groups import HybridKVCacheManager, chunked
from tokenbudget.server import LLM

from .test_chunked_local import CHUNK, _build_llama4
from .test_hybrid_kv import BS, NEW, WINDOW, _build_gemma2, _expected, _prompts

# Per model: its KV group windows, the span a window (chunk) covers, and for
# the n > 1 tests the length of the sampled prompt and a pool size with which
# the samples themselves are preempted, mid-prefill or mid-decode.
MODELS = {
    "gemma2": ((0, WINDOW), WINDOW, 3 * WINDOW + 5, 26),
    "llama4": ((0, chunked(CHUNK)), CHUNK, 4 * CHUNK + 5, 32),
}
SAMPLED = 2 * NEW  # tokens per sample


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> tuple[str, tuple[int, ...], int, int, int]:
    path = tmp_path_factory.mktemp(request.param)
    built = _build_gemma2(path) if request.param == "gemma2" else _build_llama4(path, CHUNK)
    return built, *MODELS[request.param]


def _llm(path: str, windows: tuple[int, ...], num_blocks: int, **kw) -> LLM:
    # 24-token steps cut the prompts across window (chunk) boundaries.
    llm = LLM(
        path,
        max_num_batched_tokens=24,
        num_gpu_blocks=num_blocks,
        block_size=BS,
        max_model_len=96,
        **kw,
    )
    assert llm.engine.cache_config.kv_group_windows == windows
    assert isinstance(llm.engine.scheduler.kv_cache_manager, HybridKVCacheManager)
    return llm


def _all_blocks_free(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_usable


def _hf_logprobs(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


def _assert_prompt_logprobs(plp, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        row = expected[j - 1]  # the logits at position j - 1 predict token j
        top = row.topk(k).indices.tolist()
        assert set(plp[j]) == {prompt[j], *top}, j
        got = np.array([plp[j][t] for t in [prompt[j], *top]])
        np.testing.assert_allclose(got, row[[prompt[j], *top]].numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
def test_prompt_logprobs_equal_transformers_across_chunks_windows_and_preemption(
    model, backend, async_scheduling
):
    path, windows, span, _, _ = model
    prompts = _prompts(3, [4 * span + 5, 70, 60], seed=7)  # several windows long
    expected = _hf_logprobs(path, prompts)
    # Too few blocks for all three at once: one is preempted and recomputes.
    llm = _llm(path, windows, 30, attention_backend=backend, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, prompt, want in zip(outs, prompts, expected):
        _assert_prompt_logprobs(out.prompt_logprobs, prompt, want, 2)
    assert llm.engine.scheduler.num_preemptions > 0
    _all_blocks_free(llm)
    llm.shutdown()


def test_prompt_logprobs_compute_a_cached_prompt_again(model):
    # The prompt's blocks are cached in every group; a request with prompt
    # logprobs reads no hit (it needs every position's logits), others do.
    path, windows, span, _, _ = model
    prompt = _prompts(1, [4 * span + 5], seed=9)[0]
    expected = _hf_logprobs(path, [prompt])[0]
    llm = _llm(path, windows, num_blocks=40)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == first.token_ids
    _assert_prompt_logprobs(out.prompt_logprobs, prompt, expected, 1)
    other = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    assert other.num_cached_tokens >= 4 * BS and other.prompt_logprobs is None
    assert other.token_ids == first.token_ids
    _all_blocks_free(llm)
    llm.shutdown()


def _after_neighbours(model, params: SamplingParams) -> tuple[LLM, list[int], list, list]:
    """An engine with a small pool, and a batch: two other requests, then a
    prompt several windows long whose samples, admitted last, are preempted."""
    path, windows, _, prompt_len, num_blocks = model
    prompt = _prompts(1, [prompt_len], seed=13)[0]
    others = _prompts(2, [60, 60], seed=5)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in [*others, prompt]]
    return _llm(path, windows, num_blocks), prompt, batch, [greedy, greedy, params]


def test_n_greedy_samples_each_equal_transformers_under_preemption(model):
    params = SamplingParams(n=3, max_tokens=SAMPLED, temperature=0, ignore_eos=True, logprobs=0)
    llm, prompt, batch, per_request = _after_neighbours(model, params)
    others = [p["prompt_token_ids"] for p in batch[:2]]
    expected = _expected(model[0], others, NEW) + _expected(model[0], [prompt], SAMPLED)
    outs = llm.generate(batch, per_request)
    assert [o.token_ids for o in outs[:2]] == expected[:2]
    samples = outs[2].outputs
    assert [o.token_ids for o in samples] == [expected[2]] * 3
    # Samples 1 and 2 read the prompt's blocks cached by sample 0 in every
    # group; their logprobs (not only the argmax) show the KV they read.
    assert [o.num_cached_tokens > 0 for o in samples] == [False, True, True]
    ref = _hf_logprobs(model[0], [prompt + expected[2]])[0][len(prompt) - 1 : -1]
    want = ref.gather(1, torch.tensor(expected[2])[:, None])[:, 0].numpy()
    for o in samples:
        got = [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert llm.engine.scheduler.num_preemptions > 0
    _all_blocks_free(llm)
    llm.shutdown()


def test_n_seeded_samples_each_equal_their_seed_alone_under_preemption(model):
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=SAMPLED, ignore_eos=True)
    llm, prompt, batch, per_request = _after_neighbours(model, params)
    samples = [o.token_ids for o in llm.generate(batch, per_request)[2].outputs]
    assert llm.engine.scheduler.num_preemptions > 0
    _all_blocks_free(llm)
    assert len({tuple(s) for s in samples}) == 3
    # Sample i is what seed + i gives alone, computing the prompt itself.
    for i, tokens in enumerate(samples):
        llm.engine.scheduler.reset_prefix_cache()
        alone = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(seed=11 + i, temperature=1.0, max_tokens=SAMPLED, ignore_eos=True),
        )[0]
        assert alone.num_cached_tokens == 0 and alone.token_ids == tokens, i
    _all_blocks_free(llm)
    llm.shutdown()
