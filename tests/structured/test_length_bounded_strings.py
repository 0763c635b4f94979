"""minLength / maxLength count characters of the decoded JSON string. One
character is one whole UTF-8 encoded code point (not a control character,
'"' or '\\') or one escape sequence (a surrogate pair counts once; a lone
surrogate is refused): never a stray byte, so the output is always UTF-8.

Everything goes through the manager's own grammar on the tiny byte-level BPE,
whose vocabulary has a token for each of the 256 bytes, so the grammar alone
decides which bytes follow which."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from tokenbudget.core import SamplingParams
from tokenbudget.core.structured.manager import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
    "required": ["s"],
}


def _allowed_next(manager, req) -> list[int]:
    """The token ids the manager's bitmask allows for the request's next sample."""
    req.num_computed_tokens = req.num_tokens - 1  # decoding: the request samples
    rid = req.request_id
    bitmask, _ = manager.grammar_bitmask({rid: req}, {rid: 1}, {})
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: manager.vocab_size]
    return np.flatnonzero(bits).tolist()


def _byte_ids(token_bytes: dict[int, bytes], data: bytes) -> list[int]:
    """``data`` as one single-byte token per byte: the hardest split for a grammar."""
    single = {b[0]: i for i, b in token_bytes.items() if len(b) == 1}
    return [single[b] for b in data]


def _accepts(req, ids: list[int]) -> bool:
    """Whether the request's matcher takes ``ids`` and then EOS, ending there."""
    matcher = req.structured_request.matcher
    matcher.reset()
    return (
        all(matcher.accept_token(t) for t in ids + [req.eos_token_id]) and matcher.is_terminated()
    )


def _is_valid(data: bytes, low: int, high: int) -> bool:
    """The specification, independent of the grammar: strict UTF-8, strict JSON
    (raw control characters refused), no lone surrogate, low..high characters."""
    try:
        value = json.loads(data.decode("utf-8"))
        value.encode("utf-8")  # a lone surrogate has no encoding
    except (UnicodeError, json.JSONDecodeError):
        return False
    return isinstance(value, str) and low <= len(value) <= high


# -- random walks over the bitmask ----------------------------------------------------

# Bytes where UTF-8 encoders go wrong: the lead bytes whose second byte has a
# narrower range (E0, ED, F0, F4), their neighbours, and the ends of the
# continuation ranges.
_EDGE_BYTES = {
    bytes([b])
    for b in (
        0xC2,
        0xDF,
        0xE0,
        0xE1,
        0xEC,
        0xED,
        0xEE,
        0xEF,
        0xF0,
        0xF1,
        0xF3,
        0xF4,
        0x80,
        0x8F,
        0x90,
        0x9F,
        0xA0,
        0xBF,
    )
}


def _pick(
    rng: random.Random, allowed: list[int], token_bytes: dict[int, bytes], text: bytes
) -> int:
    """A temperature-1 sample from the allowed tokens that leans towards what
    makes length bounds hard: UTF-8 edge bytes, other multi-byte text,
    escapes (\\u ones especially), and the closing quote (so short strings
    occur too)."""
    pieces = [(t, token_bytes.get(t, b"")) for t in allowed]
    in_escape = (len(text) - len(text.rstrip(b"\\"))) % 2 == 1
    leanings = (
        ([t for t, b in pieces if in_escape and b.startswith(b"u")], 0.6),
        ([t for t, b in pieces if b in _EDGE_BYTES], 0.25),
        ([t for t, b in pieces if any(x >= 0x80 for x in b)], 0.25),
        ([t for t, b in pieces if b"\\" in b], 0.3),
        ([t for t, b in pieces if b'"' in b], 0.1),
    )
    for group, p in leanings:
        if group and rng.random() < p:
            return rng.choice(group)
    return rng.choice(allowed)


def _random_walk(manager, ready_request, token_bytes, seed: int) -> bytes:
    rng = random.Random(seed)
    req = ready_request(f"walk-{seed}", {"json_schema": SCHEMA})
    text = b""
    for _ in range(200):
        token = _pick(rng, _allowed_next(manager, req), token_bytes, text)
        req.append_output_token_ids([token])
        if manager.accept_tokens(req, [token]):
            # The walk picks allowed tokens only (a refused one raises): its end is EOS.
            assert token == req.eos_token_id, (seed, text, token)
            manager.remove_request(req)
            return text
        text += token_bytes[token]
    raise AssertionError(f"seed {seed}: no end after 200 tokens: {text!r}")


def test_random_walks_under_length_bounds_give_utf8_json_that_validates(
    manager, ready_request, token_bytes
):
    outputs = [_random_walk(manager, ready_request, token_bytes, seed) for seed in range(50)]
    strings = []
    for seed, text in enumerate(outputs):
        try:
            value = json.loads(text.decode("utf-8"))  # strict: no raw control characters
            value["s"].encode("utf-8")  # no lone surrogate
        except (UnicodeError, json.JSONDecodeError) as exc:
            raise AssertionError(f"seed {seed}: {text!r}: {exc}") from None
        jsonschema.validate(value, SCHEMA)
        strings.append(value["s"])
    # The walks reached what the bounds must count right, so the checks above
    # were not passed vacuously.
    assert sum(any(ord(c) >= 0x80 for c in s) for s in strings) >= 10, strings
    assert sum(any(ord(c) >= 0x10000 for c in s) for s in strings) >= 3, strings
    assert sum(b"\\" in t for t in outputs) >= 10, outputs
    assert sum(b"\\u" in t for t in outputs) >= 5, outputs
    assert any(re.search(rb"\\u[Dd][89ABab]", t) for t in outputs), outputs  # a surrogate pair
    assert {len(s) for s in strings} == {2, 3, 4, 5}, strings


# -- what counts as one character -----------------------------------------------------

# JSON text of one character each: escapes, raw code points of 1 to 4 bytes,
# and a surrogate pair (one code point written as two escapes).
ONE_CHARACTER = [
    "a",
    "\x7f",
    '\\"',
    "\\\\",
    "\\/",
    "\\b",
    "\\f",
    "\\n",
    "\\r",
    "\\t",
    "\\u0000",
    "\\u00e9",
    "\\uD7FF",
    "\\uE000",
    "\\uffff",
    "é",
    "€",
    "\U0001f600",
    "\U0010ffff",
    "\\ud83d\\ude00",
    "\\uDBFF\\uDFFF",
]


@pytest.mark.parametrize("piece", ONE_CHARACTER, ids=ascii)
def test_each_character_counts_once(ready_request, tokenizer, token_bytes, piece):
    req = ready_request("r", {"json_schema": {"type": "string", "minLength": 3, "maxLength": 3}})
    for n in (2, 3, 4):
        data = f'"{piece * n}"'.encode()
        expected = n == 3
        assert _is_valid(data, 3, 3) == expected, data  # the table itself is right
        assert (
            _accepts(req, tokenizer.encode(data.decode(), add_special_tokens=False)) == expected
        ), data
        assert _accepts(req, _byte_ids(token_bytes, data)) == expected, data


# Each is refused by a string schema with maxLength 5, though none is longer.
REFUSED = [
    # Raw control characters (JSON requires them escaped) ...
    *(f'"a{chr(c)}b"'.encode() for c in range(0x20)),
    # ... lone or misordered surrogate escapes, which decode to no character ...
    b'"\\ud800"',
    b'"\\uDBFF"',
    b'"\\udc00"',
    b'"\\uDFFF"',
    b'"\\ude00\\ud83d"',
    b'"\\ud83dx"',
    b'"\\ud83d\\u0041"',
    b'"\\ud83d\\ud83d"',
    # ... escapes JSON does not have ...
    b'"\\x41"',
    b'"\\U0001F600"',
    b'"\\u12"',
    b'"\\a"',
    b'"\\\'"',
    # ... and bytes that are not UTF-8: a cut character, overlong forms, encoded
    # surrogates, past U+10FFFF, a stray continuation byte, never-used bytes.
    b'"\xc3"',
    b'"\xc3a"',
    b'"\xe2\x82"',
    b'"\xf0\x9f\x98"',
    b'"\xc0\x80"',
    b'"\xc1\xbf"',
    b'"\xe0\x80\x80"',
    b'"\xe0\x9f\xbf"',
    b'"\xf0\x80\x80\x80"',
    b'"\xf0\x8f\xbf\xbf"',
    b'"\xed\xa0\x80"',
    b'"\xed\xbf\xbf"',
    b'"\xf4\x90\x80\x80"',
    b'"\xf5\x80\x80\x80"',
    b'"\x80"',
    b'"\xbf"',
    b'"\xfe"',
    b'"\xff"',
]


def test_control_characters_lone_surrogates_and_broken_utf8_are_refused(ready_request, token_bytes):
    req = ready_request("r", {"json_schema": {"type": "string", "maxLength": 5}})
    for data in REFUSED:
        assert not _is_valid(data, 0, 5), data
        assert not _accepts(req, _byte_ids(token_bytes, data)), data
    # What is refused raw is accepted escaped, and the boundaries of the refused
    # ranges are accepted.
    for data in (
        b'"a\\u0000b"',
        b'"a\\u001fb"',
        b'"a\\tb"',
        b'"\\uD7FF\\uE000"',
        b'"\xc2\x80\xdf\xbf"',
        b'"\xe0\xa0\x80\xed\x9f\xbf\xee\x80\x80"',
        b'"\xf0\x90\x80\x80\xf4\x8f\xbf\xbf"',
    ):
        assert _is_valid(data, 0, 5), data
        assert _accepts(req, _byte_ids(token_bytes, data)), data


def _utf8_proper_prefixes() -> set[bytes]:
    """Every proper prefix of the UTF-8 encoding of a non-surrogate code point.
    Code points in one aligned block of 64 differ only in their last byte, so
    every 64th one reaches all the prefixes."""
    return {
        chr(cp).encode()[:k]
        for cp in range(0x80, 0x110000, 64)
        if not 0xD800 <= cp <= 0xDFFF
        for k in range(1, len(chr(cp).encode()))
    }


def _is_one_raw_character(data: bytes) -> bool:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return len(text) == 1 and ord(text) >= 0x20 and text not in '"\\'


def test_one_raw_character_is_exactly_one_utf8_encoded_code_point(
    ready_request, token_bytes, model_vocab_size
):
    """Walk the byte tree of a one-character string: after every prefix the
    bytes allowed next are exactly those Python's UTF-8 codec says continue it
    (all of them up to the second byte, where the narrowed ranges lie)."""
    import xgrammar as xgr

    req = ready_request("r", {"json_schema": {"type": "string", "minLength": 1, "maxLength": 1}})
    matcher = req.structured_request.matcher
    token_of = {b[0]: i for i, b in token_bytes.items() if len(b) == 1}
    byte_of = {i: b for b, i in token_of.items()}
    prefixes = _utf8_proper_prefixes()
    bitmask = xgr.allocate_token_bitmask(1, model_vocab_size)
    edges = {0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF}

    def allowed_bytes() -> set[int]:
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
        return {byte_of[i] for i in np.flatnonzero(bits).tolist() if i in byte_of}

    def visit(prefix: bytes) -> None:
        if _is_one_raw_character(prefix):
            expected = {ord('"')}
        else:
            expected = {
                b
                for b in range(256)
                if prefix + bytes([b]) in prefixes or _is_one_raw_character(prefix + bytes([b]))
            }
        got = allowed_bytes()
        if not prefix:
            got.discard(ord("\\"))  # where an escape starts: the tests above
        assert got == expected, (prefix, sorted(hex(b) for b in got ^ expected))
        if expected == {ord('"')}:
            return
        for b in sorted(expected):
            if len(prefix) >= 2 and b not in edges:
                continue
            assert matcher.accept_token(token_of[b])
            visit(prefix + bytes([b]))
            matcher.rollback(1)

    assert matcher.accept_token(token_of[ord('"')])
    visit(b"")


@pytest.mark.parametrize(
    "schema, accepted, refused",
    [
        # No upper bound.
        (
            {"type": "string", "minLength": 2},
            ['"\\n\\u00e9"', '"' + "é" * 40 + '"'],
            ['"\\n"', '"é"'],
        ),
        # Only the empty string.
        ({"type": "string", "maxLength": 0}, ['""'], ['"a"', '"\\n"']),
        # JSON has one number type: 2.0 is the integer 2.
        ({"type": "string", "maxLength": 2.0}, ['"\\t\\t"'], ['"\\t\\t\\t"']),
        # Nested, as Pydantic writes an optional bounded string.
        (
            {
                "type": "array",
                "items": {"anyOf": [{"type": "string", "maxLength": 1}, {"type": "null"}]},
            },
            ['["\\u00e9", null, "😀"]'],
            ['["\\u00e9e"]', '["\x01"]'],
        ),
        # A property whose name is also a keyword.
        (
            {
                "type": "object",
                "properties": {"enum": {"type": "string", "maxLength": 1}},
                "required": ["enum"],
            },
            ['{"enum": "\\n"}'],
            ['{"enum": "\x01"}'],
        ),
    ],
)
def test_bounds_hold_for_every_shape_of_schema(ready_request, tokenizer, schema, accepted, refused):
    req = ready_request("r", {"json_schema": schema})
    for text in accepted:
        jsonschema.validate(json.loads(text), schema)
        assert _accepts(req, tokenizer.encode(text, add_special_tokens=False)), text
    for text in refused:
        assert not _accepts(req, tokenizer.encode(text, add_special_tokens=False)), text


@pytest.mark.parametrize(
    "bounds, message",
    [
        ({"maxLength": -1}, "maxLength must be a non-negative integer, got -1"),
        ({"minLength": "3"}, "minLength must be a non-negative integer, got '3'"),
        ({"maxLength": 2.5}, "maxLength must be a non-negative integer, got 2.5"),
        ({"maxLength": True}, "maxLength must be a non-negative integer, got True"),
        ({"minLength": 3, "maxLength": 2}, "minLength 3 is greater than maxLength 2"),
    ],
)
def test_bad_length_bounds_are_refused_naming_the_keyword(manager, bounds, message):
    params = SamplingParams(structured={"json_schema": {"type": "string", **bounds}}).structured
    with pytest.raises(GrammarError, match=re.escape(f"structured.json_schema: {message}")):
        manager.validate(params)
