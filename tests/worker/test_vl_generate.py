"""Vision-language models through LLM: greedy tokens equal transformers
generate() with images, with chunks cutting through images, a shared image,
and preemption (the vision tower re-runs for the recomputed prompt)."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM
from tokenbudget.server.engine.mm_processor import MultiModalProcessor
from tokenbudget.server.testing.tiny_vl_models import (
    build_tiny_qwen2_5_vl,
    build_tiny_qwen3_vl,
    hf_generate_vl_ids,
)

BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen3_vl": build_tiny_qwen3_vl}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def vl_case(request, tmp_path_factory, vl_chats):
    from transformers import AutoModelForImageTextToText

    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    processor = MultiModalProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for chat in vl_chats:
        ids, features = processor.process_messages(chat)
        expected.append(hf_generate_vl_ids(model, ids, features, 8, ignore_eos=True))
    return path, expected


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunks start and end inside images
        {"block_size": 4, "num_gpu_blocks": 19, "enable_prefix_caching": False},  # preemption
    ],
    ids=["one-batch", "chunked", "preempted"],
)
def test_vl_greedy_equals_transformers_generate(vl_case, vl_chats, engine_args):
    path, expected = vl_case
    engine_args.setdefault("num_gpu_blocks", 64)
    llm = LLM(path, dtype="float32", device="cpu", **engine_args)
    results = llm.generate(
        [{"messages": c} for c in vl_chats],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    assert [r.token_ids for r in results] == expected
    if "block_size" in engine_args:
        assert llm.engine.scheduler.make_stats().num_preemptions > 0


def test_vision_tower_keeps_its_own_attention(vl_case):
    from tokenbudget.worker.attention import PAGED_ATTENTION
    from tokenbudget.worker.loader import load_model

    model = load_model(vl_case[0], dtype="float32")
    assert model.config.text_config._attn_implementation == PAGED_ATTENTION
    assert model.config.vision_config._attn_implementation == "sdpa"
