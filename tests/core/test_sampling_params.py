"""SamplingParams reject bad values with a ValueError that names the field."""
from __future__ import annotations

import pytest

from tokenbudget.core import SamplingParams, StructuredOutputParams


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be <= max_tokens \(4\), got 5"),
    ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
    ({"temperature": float("nan")}, "temperature must be a number"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -2}, "top_k must be >= -1, got -2"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"stop_token_ids": [3, -4]}, "stop_token_ids must be >= 0, got -4"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids must be an integer"),
    ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
    ({"structured": {"regex": "a", "choice": ["x"]}}, "structured must set exactly one of"),
    ({"structured": {}}, "structured must set exactly one of"),
    ({"structured": {"xml": "<a/>"}}, r"structured: unknown key\(s\) \['xml'\]"),
    ({"structured": {"regex": ""}}, "structured.regex must be a non-empty string"),
    ({"structured": {"choice": []}}, "structured.choice must be a non-empty list"),
    ({"structured": {"json_schema": 3}}, "structured.json_schema must be a str or a dict"),
    ({"structured": "regex"}, "structured must be a dict or StructuredOutputParams, got str"),
])
def test_invalid_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_params_are_normalised():
    p = SamplingParams(max_tokens=4, min_tokens=4, temperature=0, top_k=0, seed=0,
                       stop_token_ids=(7, 8), logprobs=0, structured={"choice": ["yes", "no"]})
    assert p.greedy
    assert p.stop_token_ids == [7, 8]
    assert isinstance(p.structured, StructuredOutputParams)
    assert p.structured.kind == "choice"


def test_structured_key_is_canonical_for_equal_schemas():
    a = StructuredOutputParams(json_schema={"type": "object", "required": ["x"]})
    b = StructuredOutputParams(json_schema={"required": ["x"], "type": "object"})
    assert a.key() == b.key()
    assert a.key() != StructuredOutputParams(json_object=True).key()
