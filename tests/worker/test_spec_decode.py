"""Speculative decoding with the n-gram proposer, end to end through LLM: greedy tokens
equal transformers generate() and the engine without drafts (chunked prefill, prefix hits,
preemption, async scheduling, a VL model); seeded and structured sampling give the very
same tokens as without drafts. Each case checks that drafts were both accepted and
rejected, so the verification path ran."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
NUM_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def make_llm(path, spec=SPEC, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks", 256)
    kwargs.setdefault("async_scheduling", False)  # the async cases ask for it
    return LLM(path, dtype="float32", device="cpu", speculative_config=spec, **kwargs)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def assert_drafts_verified(llm: LLM) -> None:
    """Drafts were scheduled, and some were accepted and some rejected."""
    stats = llm.engine.scheduler.make_stats().spec_decoding
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def assert_overlap(recorder, async_scheduling: bool) -> None:
    """Async still overlaps the steps that verify no drafts; sync never overlaps; a
    step verifying drafts runs alone (how many it accepts decides the next step)."""
    overlaps = recorder.num_overlapped_steps
    assert overlaps > 0 if async_scheduling else overlaps == 0
    assert recorder.drafted and recorder.num_steps_beside_drafts == 0


@pytest.fixture(scope="module")
def expected(prompts, hf_greedy):
    return [hf_greedy(p, NUM_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 64},  # chunked prefill beside drafts
        {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 24, "block_size": 4},
        {"async_scheduling": True},
        {"async_scheduling": True, "max_num_batched_tokens": 64},
    ],
    ids=[
        "one-batch",
        "chunked-prefill",
        "small-chunks-small-blocks",
        "async",
        "async-chunked-prefill",
    ],
)
def test_greedy_with_drafts_equals_transformers_generate(
    tiny_qwen3_path, prompts, expected, overlap_recorder, engine_args
):
    llm = make_llm(tiny_qwen3_path, **engine_args)
    recorder = llm.engine.executor = overlap_recorder(llm.engine.executor)
    results = llm.generate(token_prompts(prompts), GREEDY)
    assert [r.token_ids for r in results] == expected
    assert_overlap(recorder, engine_args.get("async_scheduling", False))
    assert_drafts_verified(llm)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1  # no block leaked


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_hits_keep_the_output(
    tiny_qwen3_path, prompts, expected, overlap_recorder, async_scheduling
):
    llm = make_llm(tiny_qwen3_path, async_scheduling=async_scheduling)
    recorder = llm.engine.executor = overlap_recorder(llm.engine.executor)
    first = llm.generate(token_prompts(prompts[-3:]), GREEDY)
    again = llm.generate(token_prompts(prompts[-3:]), GREEDY)
    assert all(r.num_cached_tokens > 0 for r in again)
    assert [r.token_ids for r in again] == [r.token_ids for r in first] == expected[-3:]
    assert_overlap(recorder, async_scheduling)
    assert_drafts_verified(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_with_drafts_recompute_and_match(
    tiny_qwen3_path, hf_greedy, overlap_recorder, async_scheduling
):
    # Seed 3: outputs that repeat enough for drafts to be accepted in both modes (async
    # drops the drafts proposed while a step was in flight, so it verifies fewer).
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 1000, size=60).tolist() for _ in range(4)]
    llm = make_llm(tiny_qwen3_path, num_gpu_blocks=20, async_scheduling=async_scheduling)
    recorder = llm.engine.executor = overlap_recorder(llm.engine.executor)
    results = llm.generate(token_prompts(prompts), GREEDY)
    assert llm.engine.scheduler.make_stats().num_preemptions > 0
    assert [r.token_ids for r in results] == [hf_greedy(p, NUM_TOKENS) for p in prompts]
    assert_overlap(recorder, async_scheduling)
    assert_drafts_verified(llm)


SAMPLED = [
    SamplingParams(max_tokens=NUM_TOKENS, temperature=0.5, seed=3, ignore_eos=True, logprobs=2),
    SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.8, top_k=20, top_p=0.9, seed=4, ignore_eos=True
    ),
    SamplingParams(
        max_tokens=NUM_TOKENS,
        temperature=0.6,
        min_p=0.1,
        seed=5,
        repetition_penalty=1.3,
        frequency_penalty=1.0,
        presence_penalty=0.1,
        ignore_eos=True,
    ),
    SamplingParams(
        max_tokens=NUM_TOKENS, temperature=1.0, seed=6, ignore_eos=True, logit_bias={100: 2.0}
    ),
    # EOS masked on rows (draft rows too) with fewer than min_tokens outputs before them.
    SamplingParams(
        max_tokens=NUM_TOKENS,
        temperature=1.0,
        seed=7,
        min_tokens=30,
        stop_token_ids=[101],
        logit_bias={101: 5.0},
    ),
]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_drafts(
    tiny_qwen3_path, prompts, async_scheduling
):
    """The verification step draws row t from the randomness a plain step would use for
    that output position, and rewinds the request's generator past rejected rows."""
    batch = token_prompts(prompts[:5]) * 2
    params = SAMPLED + [SamplingParams(**{**_fields(p), "seed": p.seed + 10}) for p in SAMPLED]
    plain = make_llm(tiny_qwen3_path, spec=None).generate(batch, params)
    llm = make_llm(tiny_qwen3_path, async_scheduling=async_scheduling)
    drafted = llm.generate(batch, params)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    for d, p in zip(drafted[:1], plain[:1]):  # logprobs=2: the same entries, same values
        assert [lp.keys() for lp in d.logprobs] == [lp.keys() for lp in p.logprobs]
        for a, b in zip(d.logprobs, p.logprobs):
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert_drafts_verified(llm)


def _fields(params: SamplingParams) -> dict:
    return {
        name: getattr(params, name)
        for name in (
            "max_tokens",
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "seed",
            "ignore_eos",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "min_tokens",
            "stop_token_ids",
        )
    }


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_structured_requests_with_drafts_follow_their_grammar(tiny_qwen3_path, async_scheduling):
    regex = r"(ab|ba){6,12}[0-9]{2}"
    params = [
        SamplingParams(temperature=0.7, seed=s, max_tokens=48, structured={"regex": regex})
        for s in range(4)
    ] + [SamplingParams(temperature=0.0, max_tokens=48, structured={"regex": regex})]
    prompts = ["abab", "The quick brown fox", "baba ab", "Numbers: 0 1 2", "ab ba ab"]
    plain = make_llm(tiny_qwen3_path, spec=None).generate(prompts, params)
    llm = make_llm(tiny_qwen3_path, async_scheduling=async_scheduling)
    drafted = llm.generate(prompts, params)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert all(re.fullmatch(regex, r.text) for r in drafted), [r.text for r in drafted]
    assert llm.engine.scheduler.make_stats().spec_decoding.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def tiny_vl_path(tmp_path_factory) -> str:
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl_spec"))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_vl_greedy_with_drafts_equals_transformers_generate(
    tiny_vl_path, vl_chats, overlap_recorder, async_scheduling
):
    from transformers import AutoModelForImageTextToText

    from tokenbudget.server.engine.mm_processor import MultiModalProcessor
    from tokenbudget.server.testing.tiny_vl_models import hf_generate_vl_ids

    path = tiny_vl_path
    processor = MultiModalProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    expected = [
        hf_generate_vl_ids(model, *processor.process_messages(chat), 24, ignore_eos=True)
        for chat in vl_chats
    ]
    llm = make_llm(
        path,
        max_num_batched_tokens=16,
        num_gpu_blocks=64,  # chunks cut images
        async_scheduling=async_scheduling,
    )
    recorder = llm.engine.executor = overlap_recorder(llm.engine.executor)
    results = llm.generate(
        [{"messages": c} for c in vl_chats],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    )
    assert [r.token_ids for r in results] == expected
    assert_overlap(recorder, async_scheduling)
    assert_drafts_verified(llm)
