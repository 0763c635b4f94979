"""Pooling (embedding) requests: how a prompt's hidden states become one vector.

``PoolerConfig`` is the model's default (vLLM's name): from the checkpoint's
sentence-transformers files, else by architecture, else the engine setting
``pooler_config``. ``PoolingParams`` is what one request asks for; a field
left None takes the model's default (``resolve``). The scheduler only ever
sees resolved params.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# LAST: the last prompt token's hidden state (Qwen3-Embedding, decoder
# embedders); MEAN: the mean over every prompt token; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


def _check_pooling_type(value: Any, field: str) -> str:
    if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
        raise ValueError(f"{field} must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
    return value.upper()


def _check_normalize(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be true or false, got {value!r}")
    return value


@dataclass(slots=True)
class PoolingParams:
    """One pooling request's options; None takes the model's default."""

    pooling_type: str | None = None
    # L2-normalise the pooled vector (cosine similarity becomes a dot product).
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = _check_pooling_type(self.pooling_type, "pooling_type")
        if self.normalize is not None:
            _check_normalize(self.normalize, "normalize")

    @property
    def is_resolved(self) -> bool:
        return self.pooling_type is not None and self.normalize is not None

    def resolve(self, default: PoolerConfig) -> PoolingParams:
        """These params with the model's default where a field is unset."""
        return PoolingParams(
            self.pooling_type if self.pooling_type is not None else default.pooling_type,
            self.normalize if self.normalize is not None else default.normalize,
        )


@dataclass(slots=True)
class PoolerConfig:
    """A model's default pooling (vLLM's ``PoolerConfig``, its two fields we honour)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = _check_pooling_type(self.pooling_type, "pooler_config.pooling_type")
        _check_normalize(self.normalize, "pooler_config.normalize")

    @staticmethod
    def overrides(value: dict | str | None) -> dict[str, Any]:
        """The fields a ``pooler_config`` setting (a dict or its JSON text, as
        vLLM's ``--pooler-config``) overrides, checked; raises ValueError
        naming a bad or unsupported key."""
        if value is None:
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"pooler_config: not JSON ({exc}); expected e.g. "
                    '\'{"pooling_type": "MEAN", "normalize": false}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        out: dict[str, Any] = {}
        for key, v in value.items():
            if key == "pooling_type":
                out[key] = _check_pooling_type(v, "pooler_config.pooling_type")
            elif key == "normalize":
                out[key] = _check_normalize(v, "pooler_config.normalize")
            else:
                raise ValueError(
                    f"pooler_config.{key}: not supported (only pooling_type and normalize)"
                )
        return out
