"""Tiny checkpoints built once per session and loaded through the real loading code,
plus the transformers oracle the engine's outputs are compared with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.server.testing.tiny_models import QWEN_SPECIAL_TOKENS
from tokenbudget.server.testing.tiny_vl_models import random_png

# Mixed prompt lengths: short, a block boundary (16), long ones that chunk.
PROMPT_LENS = (3, 7, 16, 33, 64, 100, 180, 300)


@pytest.fixture(scope="session")
def prompts(hf_model) -> list[list[int]]:
    """Seeded random token ids, avoiding the special tokens."""
    rng = np.random.default_rng(0)
    low, high = len(QWEN_SPECIAL_TOKENS), hf_model.config.vocab_size - 64
    return [rng.integers(low, high, size=n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """The oracle: transformers generate(), greedy, exactly max_new_tokens (EOS ignored)."""

    def generate(prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
            )
        return out[0, len(prompt) :].tolist()

    return generate


@pytest.fixture(scope="session")
def hf_greedy_16(hf_greedy, prompts) -> list[list[int]]:
    return [hf_greedy(p, 16) for p in prompts]


@pytest.fixture(scope="session")
def vl_chats() -> list[list[dict]]:
    """Two chats sharing one image; the first has two images."""
    a, b = random_png(60, 90, seed=1), random_png(70, 120, seed=2)
    return [
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image", "image": a},
                    {"type": "text", "text": "with"},
                    {"type": "image", "image": b},
                    {"type": "text", "text": "please."},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": b}, {"type": "text", "text": "What is it?"}],
            }
        ],
    ]
