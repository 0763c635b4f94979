"""tokenbudget: a phase-free, token-budget LLM serving engine.

    from tokenbudget import LLM, SamplingParams, Client

The names load on first use, so ``import tokenbudget.core`` stays free of
torch and of the server."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("tokenbudget")
except PackageNotFoundError:  # run from a checkout that is not installed
    __version__ = "0+unknown"

_EXPORTS = {
    "LLM": "tokenbudget.server.entrypoints.llm",
    "GenerationResult": "tokenbudget.server.entrypoints.llm",
    "Client": "tokenbudget.server.entrypoints.client",
    "SamplingParams": "tokenbudget.core.sampling_params",
    "PoolingParams": "tokenbudget.core.pooling_params",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokenbudget' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
