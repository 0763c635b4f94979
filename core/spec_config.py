"""Speculative decoding settings, given as vLLM's ``speculative_config`` dict.

``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 5}'`` on the command line (JSON) or
the same dict in ``LLM(..., speculative_config=...)``. The scheduler only needs
``num_speculative_tokens`` (draft slots per request and step); the worker builds
the proposer from the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The proposers tokenbudget has. vLLM's model-based ones (eagle, medusa, mtp,
# draft_model) need a second model in the worker, which does not exist here.
SPEC_METHODS = ("ngram",)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    # ngram: prompt lookup: drafts copy what followed the most recent earlier
    # occurrence of the sequence's last n tokens (worker/spec_decode/ngram.py).
    method: str = "ngram"
    num_speculative_tokens: int = 1
    # Lengths n of the suffix looked up, longest first (vLLM's meaning).
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of "
                f"{', '.join(map(repr, SPEC_METHODS))}, got {self.method!r} "
                "(model-based drafters are not supported)"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"speculative_config.{name} must be an integer, got {value!r}")
            if value < 1:
                raise ValueError(f"speculative_config.{name} must be >= 1, got {value}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                f"must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """A dict, its JSON text, a SpeculativeConfig or None (off). As in vLLM,
        ``num_speculative_tokens`` is required, and a missing lookup bound takes
        the other's value (both missing: 5)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict (JSON object) such as "
                '{"method": "ngram", "num_speculative_tokens": 4}, '
                f"got {type(value).__name__}"
            )
        known = [f.name for f in fields(cls)]
        for key in value:
            if key not in known:
                raise ValueError(
                    f"speculative_config: unknown key {key!r} (known: {', '.join(known)})"
                )
        if "method" not in value:
            raise ValueError('speculative_config.method is required (e.g. "ngram")')
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        values = dict(value)
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5
        values["prompt_lookup_min"] = high if low is None else low
        values["prompt_lookup_max"] = low if high is None else high
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
