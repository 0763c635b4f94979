"""Tiny checkpoints built once per session and loaded through the real loading code."""
from __future__ import annotations

import pytest

from tokenbudget.worker.tiny_models import build_tiny_qwen3


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> str:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)
