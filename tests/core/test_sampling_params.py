"""SamplingParams reject bad values with a ValueError that names the field."""

from __future__ import annotations

import pytest

from tokenbudget.core import SamplingParams, StructuredOutputParams


def _nested_dict(depth: int) -> dict:
    root = node = {}
    for _ in range(depth):
        node["items"] = node = {}
    return root


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be <= max_tokens \(4\), got 5"),
        ({"temperature": -0.1}, r"temperature must be in \[0, 10000.0\], got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, "top_k must be >= -1, got -2"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
        ({"stop_token_ids": [3, -4]}, "stop_token_ids must be >= 0, got -4"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be an integer"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"stop": ["ok", ""]}, r"stop\[1\] must be a non-empty string"),
        ({"stop": [3]}, r"stop\[0\] must be a non-empty string, got 3"),
        ({"stop": {"a": 1}}, "stop must be a list, got dict"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a bool"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 100.0\], got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\], got 2.5"),
        ({"presence_penalty": -3}, r"presence_penalty must be in \[-2, 2\], got -3"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict of token id -> bias, got list"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias key must be >= 0, got -1"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias key must be a token id \\(digits 0-9\\), got 'x'"),
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be in \[-100.0, 100.0\], got 101"),
        ({"logit_bias": {5: "big"}}, r"logit_bias\[5\] must be a finite number"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be >= 0, got -2"),
        ({"bad_words": [""]}, r"bad_words\[0\] must be a non-empty string"),
        ({"bad_words_token_ids": [[1], []]}, r"bad_words_token_ids\[1\] must not be empty"),
        ({"bad_words_token_ids": [1, 2]}, r"bad_words_token_ids\[0\] must be a list, got int"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": 129}, "n must be <= 128, got 129"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0, got -1"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool"),
        ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens must be a bool"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1, got 0"),
        ({"structured": {"regex": "a", "choice": ["x"]}}, "structured must set exactly one of"),
        ({"structured": {}}, "structured must set exactly one of"),
        ({"structured": {"xml": "<a/>"}}, r"structured: unknown key\(s\) \['xml'\]"),
        ({"structured": {"regex": ""}}, "structured.regex must be a non-empty string"),
        ({"structured": {"choice": []}}, "structured.choice must be a non-empty list"),
        ({"structured": {"json_schema": 3}}, "structured.json_schema must be a str or a dict"),
        # Deeper schemas take seconds to parse (issue 10); a dict that deep would
        # overflow json.dumps' recursion.
        (
            {"structured": {"json_schema": '{"items": ' * 65 + "{}" + "}" * 65}},
            "structured.json_schema: nested 66 levels deep, more than 64",
        ),
        (
            {"structured": {"json_schema": _nested_dict(5000)}},
            "structured.json_schema: nested 5001 levels deep",
        ),
        ({"structured": "regex"}, "structured must be a dict or StructuredOutputParams, got str"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_params_are_normalised():
    p = SamplingParams(
        max_tokens=4,
        min_tokens=4,
        temperature=0,
        top_k=0,
        seed=0,
        stop_token_ids=(7, 8),
        logprobs=0,
        structured={"choice": ["yes", "no"]},
    )
    assert p.greedy
    assert p.stop_token_ids == [7, 8]
    assert isinstance(p.structured, StructuredOutputParams)
    assert p.structured.kind == "choice"


def test_new_fields_are_normalised():
    # A bare string is one stop string / one bad word, as in vLLM; JSON's string keys of
    # logit_bias become token ids.
    p = SamplingParams(
        stop="END",
        bad_words="darn",
        logit_bias={"17": 5, 3: -1.5},
        allowed_token_ids=(4, 5),
        bad_words_token_ids=[(1, 2)],
    )
    assert p.stop == ["END"] and p.bad_words == ["darn"]
    assert p.logit_bias == {17: 5.0, 3: -1.5}
    assert p.allowed_token_ids == [4, 5] and p.bad_words_token_ids == [[1, 2]]
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_structured_key_is_canonical_for_equal_schemas():
    a = StructuredOutputParams(json_schema={"type": "object", "required": ["x"]})
    b = StructuredOutputParams(json_schema={"required": ["x"], "type": "object"})
    assert a.key() == b.key()
    assert a.key() != StructuredOutputParams(json_object=True).key()
