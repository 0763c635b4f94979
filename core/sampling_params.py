"""Sampling parameters, validated on construction."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(slots=True)
class StructuredOutputParams:
    """Exactly one constraint on the generated text (xgrammar compiles it)."""

    json_schema: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured must set exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}; got {given or 'none'}")
        if self.json_schema is not None and not isinstance(self.json_schema, (str, dict)):
            raise ValueError("structured.json_schema must be a str or a dict")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable, canonical key (for the compiled-grammar cache)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        return kind, str(value)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputParams | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(STRUCTURED_KINDS)
            if unknown:
                raise ValueError(f"structured: unknown key(s) {sorted(unknown)}; "
                                 f"expected one of {', '.join(STRUCTURED_KINDS)}")
            return cls(**value)
        raise ValueError(f"structured must be a dict or StructuredOutputParams, got "
                         f"{type(value).__name__}")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 (or 0) disables top-k.
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top logprobs to return per generated token, or None.
    logprobs: int | None = None
    structured: StructuredOutputParams | dict | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        self.structured = StructuredOutputParams.coerce(self.structured)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
