"""Greedy tokens through LLM equal transformers generate(), token for token, in
float32 on CPU: mixed batches, chunked prefill, prefix-cache hits, preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks", 256)
    kwargs.setdefault("async_scheduling", False)  # the async case asks for it
    return LLM(path, dtype="float32", device="cpu", **kwargs)


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 64},  # chunked prefill
        {"async_scheduling": True},  # worker feeds its own tokens
        {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 24, "block_size": 4},
        # The compiled decoder (worker/compiled.py): one trace for every step.
        {"max_num_batched_tokens": 64, "enforce_eager": False},
        {"async_scheduling": True, "enforce_eager": False},
    ],
    ids=[
        "one-batch",
        "chunked-prefill",
        "async",
        "small-chunks-small-blocks",
        "compiled-chunked-prefill",
        "compiled-async",
    ],
)
def test_greedy_batch_equals_transformers_generate(
    tiny_qwen3_path, prompts, hf_greedy_16, overlap_recorder, engine_args
):
    llm = make_llm(tiny_qwen3_path, **engine_args)
    recorder = llm.engine.executor = overlap_recorder(llm.engine.executor)
    results = llm.generate(token_prompts(prompts), GREEDY)
    # Async sends step N+1 before applying step N's result; sync never does.
    overlaps = recorder.num_overlapped_steps
    assert overlaps >= 10 if engine_args.get("async_scheduling") else overlaps == 0
    assert [r.token_ids for r in results] == hf_greedy_16
    compiled = llm.engine.executor.worker.model_runner.compiled
    assert (compiled is not None) == (engine_args.get("enforce_eager") is False)
    assert all(r.finish_reason == "length" for r in results)
    assert [r.prompt_token_ids for r in results] == prompts


def test_repeated_prompt_hits_prefix_cache_and_keeps_output(tiny_qwen3_path, prompts, hf_greedy_16):
    llm = make_llm(tiny_qwen3_path)
    first = llm.generate(token_prompts(prompts[-2:]), GREEDY)
    again = llm.generate(token_prompts(prompts[-2:]), GREEDY)
    assert [r.num_cached_tokens for r in first] == [0, 0]
    # Full blocks only, and never the last prompt token.
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 16 * 16 for p in prompts[-2:]]
    assert [r.token_ids for r in again] == [r.token_ids for r in first] == hf_greedy_16[-2:]


@pytest.fixture(scope="module")
def crowded(hf_greedy):
    """Four 60-token prompts growing to 100 tokens: 16 blocks of 16 admit them
    all, but growing needs 28, so running requests must be preempted."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 1000, size=60).tolist() for _ in range(4)]
    return prompts, [hf_greedy(p, 40) for p in prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_requests_recompute_and_match(tiny_qwen3_path, crowded, prefix_caching):
    prompts, expected = crowded
    llm = make_llm(tiny_qwen3_path, num_gpu_blocks=20, enable_prefix_caching=prefix_caching)
    results = llm.generate(
        token_prompts(prompts), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    )
    assert llm.engine.scheduler.make_stats().num_preemptions > 0
    assert [r.token_ids for r in results] == expected


def test_seeded_sampling_survives_preemption(tiny_qwen3_path, crowded):
    """The worker keeps a preempted request's generator: after recomputation
    the seeded stream continues exactly where it stopped."""
    prompts, _ = crowded
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, top_k=50, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    roomy = make_llm(tiny_qwen3_path).generate(token_prompts(prompts), params)
    tight_llm = make_llm(tiny_qwen3_path, num_gpu_blocks=20, enable_prefix_caching=False)
    tight = tight_llm.generate(token_prompts(prompts), params)
    assert tight_llm.engine.scheduler.make_stats().num_preemptions > 0
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]


def test_logprobs_are_log_softmax_of_transformers_logits(tiny_qwen3_path, prompts, hf_model):
    llm = make_llm(tiny_qwen3_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    results = llm.generate(token_prompts(prompts[:4]), params)
    for prompt, res in zip(prompts, results):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + res.token_ids])).logits[0]
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)
        assert len(res.logprobs) == len(res.token_ids) == 8
        for step, (token, lp) in enumerate(zip(res.token_ids, res.logprobs)):
            top5 = set(ref[step].topk(5).indices.tolist())
            assert token in lp and set(lp) == top5 | {token}
            for tid, value in lp.items():
                assert abs(value - ref[step, tid].item()) < 1e-4


def test_text_prompts_and_chat_messages_are_tokenized_like_the_tokenizer(tiny_qwen3_path, hf_model):
    llm = make_llm(tiny_qwen3_path)
    tok = llm.tokenizer
    messages = [{"role": "user", "content": "What is paged attention?"}]
    chat_ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text_res, chat_res = llm.generate(
        ["The quick brown fox", {"messages": messages}],
        SamplingParams(max_tokens=8, temperature=0.0),
    )
    assert text_res.prompt_token_ids == tok.encode("The quick brown fox")
    assert chat_res.prompt_token_ids == list(chat_ids)
    assert chat_res.text == tok.decode(chat_res.token_ids, skip_special_tokens=True)
