"""Shared fixtures: the three tiny VL checkpoints (built once per session),
their loaded models and processors, and small test images."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tokenbudget.server.testing.tiny_vl_models import random_png

torch.set_num_threads(1)


@dataclass
class VL:
    name: str
    path: str
    model: torch.nn.Module
    processor: object  # tokenbudget.server.engine.mm_processor.MultiModalProcessor


def _load(name: str, path: str) -> VL:
    from transformers import AutoModelForImageTextToText

    from tokenbudget.server.engine.mm_processor import MultiModalProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return VL(name, path, model, MultiModalProcessor.from_pretrained(path))


@pytest.fixture(scope="session")
def qwen2_vl(tmp_path_factory) -> VL:
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_vl

    return _load("qwen2_vl", build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl")))


@pytest.fixture(scope="session")
def qwen2_5_vl(tmp_path_factory) -> VL:
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl

    return _load("qwen2_5_vl", build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="session")
def qwen3_vl(tmp_path_factory) -> VL:
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen3_vl

    return _load("qwen3_vl", build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl")))


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def vl(request) -> VL:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def images() -> list[bytes]:
    """Two images of different shapes (several merged tokens each, more than one
    attention window for Qwen2.5-VL)."""
    return [random_png(60, 90, seed=1), random_png(70, 120, seed=2)]


@pytest.fixture(scope="session")
def make_png():
    return random_png


def user_chat(*parts) -> list[dict]:
    """One user message; str parts are text, bytes/PIL parts are images."""
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="session")
def make_chat():
    return user_chat


@pytest.fixture(scope="session")
def two_image_chat(images) -> list[dict]:
    return user_chat("Compare", images[0], "with", images[1], "please.")
