"""Sampling parameters, validated on construction."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# Deepest nesting of objects and arrays in a JSON schema document. xgrammar's
# time grows about with the cube of it: 200 levels took 11 s (on the request
# path, to parse), 64 take 0.06 s; real schemas nest a handful of levels.
MAX_JSON_SCHEMA_DEPTH = 64
_JSON_ESCAPE = re.compile(r"\\.", re.DOTALL)
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


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
                f"{', '.join(STRUCTURED_KINDS)}; got {given or 'none'}"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, (str, dict)):
            raise ValueError("structured.json_schema must be a str or a dict")
        if self.json_schema is not None:
            depth = _json_depth(self.json_schema)
            if depth > MAX_JSON_SCHEMA_DEPTH:
                raise ValueError(
                    f"structured.json_schema: nested {depth} levels deep, more than "
                    f"{MAX_JSON_SCHEMA_DEPTH} (deeper schemas take seconds to "
                    "minutes to compile)"
                )
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
                raise ValueError(
                    f"structured: unknown key(s) {sorted(unknown)}; "
                    f"expected one of {', '.join(STRUCTURED_KINDS)}"
                )
            return cls(**value)
        raise ValueError(
            f"structured must be a dict or StructuredOutputParams, got {type(value).__name__}"
        )


def _json_depth(value: str | dict) -> int:
    """The deepest nesting of objects and arrays, without recursion (a deep
    document must not overflow the stack)."""
    if isinstance(value, str):
        return _text_depth(_JSON_ESCAPE.sub("", value).encode("utf-8", "surrogatepass"))
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _text_depth(text: bytes, chunk: int = 1 << 20) -> int:
    """The deepest bracket nesting outside strings of JSON text without
    escapes, in numpy over 1 MiB pieces: linear, in C and in little memory
    even for the largest message (this runs before any size limit). A byte
    is inside a string when an odd number of quotes precede it (parity
    survives uint8 wrap-around); UTF-8 multi-byte characters hold no bracket."""
    raw = np.frombuffer(text, np.uint8)
    quotes = depth = deepest = 0
    for lo in range(0, raw.size, chunk):
        piece = raw[lo : lo + chunk]
        inside = (np.cumsum(piece == ord('"'), dtype=np.uint8) + quotes) & 1
        quotes = int(inside[-1])
        steps = _BRACKET_STEP[piece][inside == 0]
        steps = steps[steps != 0]
        if steps.size:
            levels = np.cumsum(steps, dtype=np.int64) + depth
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


@dataclass(slots=True)
class SamplingParams:
    """What to sample and when to stop, with vLLM's names and meanings.

    Token-id fields (``stop_token_ids``, ``logit_bias``, ``allowed_token_ids``,
    ``bad_words_token_ids``) are checked against the vocabulary by the front
    that knows it (``InputProcessor.check_params``); strings (``stop``,
    ``bad_words``) are matched or tokenized there too, since core has no
    tokenizer.
    """

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
    # Stop when the detokenized output contains one of these strings; the
    # text ends before it unless include_stop_str_in_output.
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    # transformers' semantics over prompt and output: a seen token's logit is
    # divided by it when positive, multiplied when negative. 1 = off.
    repetition_penalty: float = 1.0
    # OpenAI's semantics over the output: logit -= frequency * count
    # + presence * (count > 0).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # token id -> bias added to its logit, in [-100, 100] as OpenAI allows.
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never to generate: tokenized by the front (with and without a
    # leading space) into bad_words_token_ids; a sequence's last token is
    # banned right after the rest of it was generated.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Independent samples of the prompt (its KV is computed once and shared).
    n: int = 1
    # Top-n logprobs of every prompt token (with the prompt token itself).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Keep only the last k prompt tokens.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_number("temperature", self.temperature, 0, _MAX_TEMPERATURE)
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p, 0, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids or [])
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        self.structured = StructuredOutputParams.coerce(self.structured)
        self.stop = _string_list("stop", self.stop)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= _MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {_MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}"
            )
        _check_number("frequency_penalty", self.frequency_penalty, -2, 2)
        _check_number("presence_penalty", self.presence_penalty, -2, 2)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError(
                    "allowed_token_ids must not be empty (leave it unset to allow every token)"
                )
        if self.bad_words is not None:
            self.bad_words = _string_list("bad_words", self.bad_words) or None
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [
                _int_list(f"bad_words_token_ids[{i}]", seq, non_empty=True)
                for i, seq in enumerate(_sequence("bad_words_token_ids", self.bad_words_token_ids))
            ] or None
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Samples of one prompt; vLLM has no limit, but each one is a request of its own.
MAX_N = 128
_MAX_REPETITION_PENALTY = 100.0
# Past this the distribution is uniform to float32 precision anyway; +inf would give NaN.
_MAX_TEMPERATURE = 1e4
_MAX_LOGIT_BIAS = 100.0


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(
    name: str, value: Any, low: float | None = None, high: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and high is not None and not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _sequence(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _int_list(name: str, value: Any, *, non_empty: bool = False) -> list[int]:
    values = _sequence(name, value)
    for t in values:
        _check_int(name, t, minimum=0)
    if non_empty and not values:
        raise ValueError(f"{name} must not be empty")
    return values


def _string_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else _sequence(name, value)
    for i, s in enumerate(values):
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name}[{i}] must be a non-empty string, got {s!r}")
    return values


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        # OpenAI clients send JSON, whose object keys are strings: plain ASCII
        # digits only ('²' is a digit to str.isdigit, not to int()), and few of
        # them (int() of thousands of digits is refused, and slow).
        if isinstance(key, str):
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                shown = repr(key[:20]) + ("..." if len(key) > 20 else "")
                raise ValueError(f"logit_bias key must be a token id (digits 0-9), got {shown}")
            key = int(key)
        token = key
        _check_int("logit_bias key", token, minimum=0)
        _check_number(f"logit_bias[{token}]", bias, -_MAX_LOGIT_BIAS, _MAX_LOGIT_BIAS)
        out[token] = float(bias)
    return out or None
