"""Bounds on the strings one request may send: stop strings, bad words and
structured-output specs (issue 26). Each is checked before the costly work
(tokenizing, building the stop-string automaton, parsing and compiling a
grammar) and refused with a ValueError naming the field.

Why each bound: bad words are tokenized per request and checked by the
worker against every sampled row each step; stop strings are matched on the
event loop that streams every client's tokens, at a cost that grows with the
longest one; a compiled grammar takes about 125 times its spec's size in
memory and its compile cannot be stopped once started (the compile timeout
fails the request, not the compile), so its size bounds both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenbudget.core.config import setting
from tokenbudget.core.sampling_params import SamplingParams, StructuredOutputParams

SERVER = "server"  # the `server --help` group (args.SERVER)
# A choice list's bytes are its strings' plus this per entry (separators).
_CHOICE_ENTRY_OVERHEAD = 4


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """The per-request string bounds (EngineArgs takes these fields over)."""

    max_stop_strings: int = setting(
        1024,
        "the most stop strings one request may give (default %(default)s); they are matched "
        "together in time that does not grow with their number",
        group=SERVER,
    )
    max_stop_string_bytes: int = setting(
        256,
        "the longest stop string, in UTF-8 bytes (default %(default)s): matching costs grow "
        "with the longest one",
        group=SERVER,
    )
    max_bad_words: int = setting(
        1024,
        "the most bad_words plus bad_words_token_ids entries of one request (default "
        "%(default)s): each is tokenized, and the worker checks each every step",
        group=SERVER,
    )
    max_bad_word_bytes: int = setting(
        256,
        "the longest bad word in UTF-8 bytes, and the longest bad_words_token_ids entry in "
        "tokens (default %(default)s)",
        group=SERVER,
    )
    max_structured_bytes: int = setting(
        256 << 10,
        "the largest structured-output spec (json_schema, regex, grammar, or choice's "
        "strings together) in UTF-8 bytes, refused before it is parsed or compiled (default "
        "%(default)s = 256 KiB; a compiled grammar takes about 125 times its spec's size)",
        group=SERVER,
    )

    def __post_init__(self) -> None:
        for name in RequestLimits.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def check_counts(self, stop: int, bad_words: int = 0, bad_words_token_ids: int = 0) -> None:
        """The count bounds alone: a front checks them on the message, before
        100k strings become Python objects."""
        _check_count("stop", stop, self.max_stop_strings, "max_stop_strings")
        field = (
            "bad_words and bad_words_token_ids"
            if bad_words and bad_words_token_ids
            else ("bad_words" if bad_words else "bad_words_token_ids")
        )
        _check_count(field, bad_words + bad_words_token_ids, self.max_bad_words, "max_bad_words")

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError naming the first field past its bound."""
        stop = params.stop or []
        words = params.bad_words or []
        sequences = params.bad_words_token_ids or []
        self.check_counts(len(stop), len(words), len(sequences))
        for i, s in enumerate(stop):
            _check_bytes(f"stop[{i}]", s, self.max_stop_string_bytes, "max_stop_string_bytes")
        for i, w in enumerate(words):
            _check_bytes(f"bad_words[{i}]", w, self.max_bad_word_bytes, "max_bad_word_bytes")
        for i, seq in enumerate(sequences):
            if len(seq) > self.max_bad_word_bytes:
                raise ValueError(
                    f"bad_words_token_ids[{i}] has {len(seq)} tokens, more than "
                    f"max_bad_word_bytes={self.max_bad_word_bytes} (the server's limit)"
                )
        if isinstance(params.structured, StructuredOutputParams):
            self.check_structured(params.structured)

    def check_structured(self, structured: StructuredOutputParams) -> None:
        if structured_bytes(structured, self.max_structured_bytes) > self.max_structured_bytes:
            raise ValueError(
                f"structured.{structured.kind} is longer than max_structured_bytes="
                f"{self.max_structured_bytes} bytes (the server's limit); refused before "
                "compiling"
            )


def structured_bytes(structured: StructuredOutputParams, limit: int) -> int:
    """The spec's size in UTF-8 bytes (exact up to ``limit``; past it, any
    number above ``limit``)."""
    value = getattr(structured, structured.kind)
    if isinstance(value, bool):
        return 0  # json_object: no text
    if isinstance(value, dict):
        value = json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        total = 0
        for c in value:
            total += _utf8_len(c, limit - total) + _CHOICE_ENTRY_OVERHEAD
            if total > limit:
                break
        return total
    return _utf8_len(value, limit)


def _utf8_len(text: str, limit: int) -> int:
    # A string past the limit in characters is past it in bytes, and an ASCII
    # one is as long in both: neither needs an encoded copy.
    if len(text) > limit or text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _check_count(field: str, count: int, limit: int, flag: str) -> None:
    if count > limit:
        raise ValueError(f"{field}: {count} entries, more than {flag}={limit} (the server's limit)")


def _check_bytes(field: str, text: str, limit: int, flag: str) -> None:
    if _utf8_len(text, limit) > limit:
        raise ValueError(f"{field} is longer than {flag}={limit} bytes (the server's limit)")
