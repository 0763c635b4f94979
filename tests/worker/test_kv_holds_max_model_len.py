"""A KV cache that cannot hold one max_model_len request is refused at
start-up when max_model_len was given, and caps max_model_len (with a
warning) when it was not (issue 10, defect 1)."""

from __future__ import annotations

import logging

import pytest

from tokenbudget.core import SamplingParams
from tokenbudget.server.entrypoints.llm import LLM


def test_an_explicit_max_model_len_the_cache_cannot_hold_is_refused(tiny_qwen3_path):
    with pytest.raises(ValueError) as err:
        LLM(tiny_qwen3_path, device="cpu", num_gpu_blocks=4, block_size=16, max_model_len=2048)
    assert str(err.value).startswith(
        "num_gpu_blocks=4 (--num-gpu-blocks) gives 48 tokens of KV cache (3 blocks of 16), "
        "less than max_model_len=2048 needs (2048); raise the KV cache"
    )
    assert "lower max_model_len (--max-model-len)" in str(err.value)


def test_draft_slots_count_against_the_cache(tiny_qwen3_path):
    with pytest.raises(ValueError, match=r"max_model_len=48 \+ num_speculative_tokens=2 needs"):
        LLM(
            tiny_qwen3_path,
            device="cpu",
            num_gpu_blocks=4,
            max_model_len=48,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def test_the_default_max_model_len_is_capped_to_the_cache(tiny_qwen3_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenbudget.server.engine.core"):
        llm = LLM(
            tiny_qwen3_path, device="cpu", num_gpu_blocks=4, block_size=16, async_scheduling=False
        )
    try:
        assert llm.engine.scheduler.scheduler_config.max_model_len == 48
        assert "max_model_len lowered to 48" in caplog.text
        # A request may now run to the whole cache and finish by length.
        out = llm.generate(
            {"prompt_token_ids": list(range(1, 41))},
            SamplingParams(max_tokens=100, ignore_eos=True),
        )[0].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 8
        pool = llm.engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == 3
    finally:
        llm.shutdown()
