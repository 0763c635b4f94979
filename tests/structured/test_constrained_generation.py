"""50 temperature-1 generations of a random-weight model under each kind of
constraint: every output is well formed by an independent checker (jsonschema,
re.fullmatch, a hand-written parser of the EBNF, the choice list) and ended
because the grammar was complete (finish reason "stop", not "length")."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        # Strings are bounded so a random model finishes them.
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{0,5}$"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}

REGEX = r"[a-z]{1,6}-[0-9]{2,4}(\.[A-Z])?"

# Nested lists of small numbers: [1,[2,3],[]] ...
EBNF = r"""
root ::= list
list ::= "[" (item ("," item){0,3})? "]"
item ::= num | list
num ::= [0-9] | [1-9] [0-9]
"""

CHOICES = ["yes", "no", "maybe so", '{"quoted": "é"}']


def parse_nested_list(text: str) -> list:
    """A recursive-descent parser of EBNF above; raises ValueError if ``text`` is not one."""
    pos = 0

    def item():
        nonlocal pos
        if pos < len(text) and text[pos] == "[":
            return lst()
        m = re.compile(r"[0-9]|[1-9][0-9]").match(text, pos)
        m2 = re.compile(r"[1-9][0-9]").match(text, pos)
        m = m2 or m
        if not m:
            raise ValueError(f"number expected at {pos} in {text!r}")
        pos = m.end()
        return int(m.group())

    def lst():
        nonlocal pos
        if text[pos] != "[":
            raise ValueError(f"'[' expected at {pos} in {text!r}")
        pos += 1
        items = []
        if pos < len(text) and text[pos] != "]":
            items.append(item())
            while pos < len(text) and text[pos] == ",":
                pos += 1
                items.append(item())
        if pos >= len(text) or text[pos] != "]":
            raise ValueError(f"']' expected at {pos} in {text!r}")
        if len(items) > 4:
            raise ValueError(f"more than 4 items in {text!r}")
        pos += 1
        return items

    value = lst()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos} in {text!r}")
    return value


def _assert_all_stopped(outs) -> None:
    reasons = [o.finish_reason for o in outs]
    assert reasons == ["stop"] * len(outs), reasons


def test_json_schema_outputs_parse_and_validate(sample):
    outs = sample({"json_schema": SCHEMA}, max_tokens=300)
    _assert_all_stopped(outs)
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 40  # sampled, not one canned answer


def test_regex_outputs_fully_match(sample):
    outs = sample({"regex": REGEX}, max_tokens=64)
    _assert_all_stopped(outs)
    for o in outs:
        assert re.fullmatch(REGEX, o.text), o.text
    assert len({o.text for o in outs}) > 40


def test_ebnf_outputs_parse(sample):
    outs = sample({"grammar": EBNF}, max_tokens=300)
    _assert_all_stopped(outs)
    parsed = [parse_nested_list(o.text) for o in outs]
    assert any(any(isinstance(x, list) for x in p) for p in parsed)  # recursion is exercised


def test_choice_outputs_are_choices(sample):
    outs = sample({"choice": CHOICES}, max_tokens=32)
    _assert_all_stopped(outs)
    assert {o.text for o in outs} <= set(CHOICES)
    assert len({o.text for o in outs}) >= 3


def test_parser_rejects_what_the_grammar_does_not_allow():
    # The oracle must be able to say no, or the EBNF test proves nothing.
    for bad in ("[1,", "[01]", "[1,2,3,4,5]", "[1]]", "[[1]", "[a]", ""):
        with pytest.raises((ValueError, IndexError)):
            parse_nested_list(bad)
    assert parse_nested_list("[1,[22,[]],3]") == [1, [22, []], 3]
