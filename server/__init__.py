"""tokenbudget.server: everything above one model replica, by layer (docs/architecture.md):
``executor`` (drives workers) < ``engine`` (EngineCore, the async engine, input and
output processing) < ``sim``, ``entrypoints`` (``LLM``, gRPC services, CLI, client).

The names below load on first use, so importing a lower layer (say
``tokenbudget.server.executor``) does not import the entry points."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "tokenbudget.server.entrypoints.llm",
    "GenerationResult": "tokenbudget.server.entrypoints.llm",
    "AsyncEngine": "tokenbudget.server.engine.async_engine",
    "Client": "tokenbudget.server.entrypoints.client",
    "add_generation_servicer": "tokenbudget.server.entrypoints.grpc.generation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokenbudget.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
