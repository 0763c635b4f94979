"""Structured-output specs to xgrammar grammars: parsing (a JSON schema's
string length bounds rewritten as patterns, which xgrammar lowers to
non-JSON), the errors a bad spec gets, and the cache key of a compiled grammar.
Pure functions; xgrammar is imported only when a spec is parsed.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from tokenbudget.core.sampling_params import StructuredOutputParams


class GrammarError(ValueError):
    """A structured-output spec that cannot be parsed or compiled."""


# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: " and
# assertion boilerplate; users only need the part after it.
_XGRAMMAR_NOISE = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*|Check failed: \(.*?\) is false: ")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error message without its location and assertion prefix."""
    return _XGRAMMAR_NOISE.sub("", str(exc)).strip()


def parse_grammar(params: StructuredOutputParams, *, any_whitespace: bool = False):
    """The xgrammar ``Grammar`` for a spec (parsing only: cheap, no tokenizer).
    Raises GrammarError naming the field and the problem."""
    import xgrammar as xgr

    kind = params.kind
    value = getattr(params, kind)
    try:
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise GrammarError(f"structured.json_schema is not valid JSON: {exc}") from None
            if not isinstance(value, (dict, bool)):
                raise GrammarError(
                    f"structured.json_schema must be a JSON object, got {type(value).__name__}"
                )
            value = _bounded_strings_as_patterns(value)
            return xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=any_whitespace)
        if kind == "json_object":
            # OpenAI's json_object is an object at the top level, not any JSON value.
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        # choice: an alternation of literal strings (JSON escapes are EBNF escapes).
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
        raise GrammarError(f"structured.{kind}: {xgrammar_message(exc)}") from None


# Keys whose values are data, not subschemas.
_SCHEMA_DATA_KEYS = frozenset(("enum", "const", "default", "examples"))
# Keys whose values map names to subschemas: a name there is no keyword, even
# when it reads "enum" or "default".
_SCHEMA_MAP_KEYS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
)

# One character of a JSON string, as a regex over the JSON text: xgrammar
# matches a string's ``pattern`` against the text between the quotes with its
# escapes still written out, while JSON Schema counts the characters of the
# decoded string. So one character is one raw code point or one escape.
#
# Raw: any code point but U+0000-U+001F, '"' and '\' (JSON requires those
# escaped) and the surrogates (UTF-8 cannot encode them), as one class per
# UTF-8 encoded length, each its own alternative. xgrammar (0.2.8) turns a
# class whose ranges (adjacent ones merged) cross those lengths into bytes
# loosely, depending on the rest of the pattern: [\u0020-\ud7ff] alone also
# admits E0 80 80, an overlong form that is not UTF-8. Classes within one
# length have come out exact (tests/structured/test_length_bounded_strings.py
# walks the bytes). Its regex has no \U escape, so the four-byte range is
# written as the characters themselves.
_RAW_CHARACTER = (
    r"[ !#-\[\]-\x7f]"
    r"|[\u0080-\u07ff]"
    r"|[\u0800-\ud7ff\ue000-\uffff]"
    "|[\U00010000-\U0010ffff]"
)
_HEX = "[0-9A-Fa-f]"
# A \u escape in the surrogate range decodes to a character only as a high
# surrogate followed by a low one; that pair is one character.
_ESCAPE = (
    r'\\(?:["\\/bfnrt]'
    rf"|u[0-9A-Ca-cE-Fe-f]{_HEX}{{3}}"
    rf"|u[Dd][0-7]{_HEX}{{2}}"
    rf"|u[Dd][89ABab]{_HEX}{{2}}\\u[Dd][C-Fc-f]{_HEX}{{2}})"
)
_JSON_STRING_CHARACTER = f"(?:{_RAW_CHARACTER}|{_ESCAPE})"


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """Rewrite ``{"type": "string", "minLength"/"maxLength"}`` (no pattern) as
    the equivalent ``pattern``: a bounded repetition of one JSON string
    character. xgrammar (0.2.8, issue mlc-ai/xgrammar#800) lowers length
    bounds to a character class that admits raw control characters and no
    escapes, which is not JSON."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SCHEMA_DATA_KEYS:
            out[k] = v
        elif k in _SCHEMA_MAP_KEYS and isinstance(v, dict):
            out[k] = {name: _bounded_strings_as_patterns(s) for name, s in v.items()}
        else:
            out[k] = _bounded_strings_as_patterns(v)
    if (
        out.get("type") == "string"
        and "pattern" not in out
        and "format" not in out
        and ("minLength" in out or "maxLength" in out)
    ):
        low = _length_bound(out, "minLength", 0)
        high = _length_bound(out, "maxLength", None)
        if high is not None and low > high:
            raise GrammarError(
                f"structured.json_schema: minLength {low} is greater than "
                f"maxLength {high}; no string satisfies both"
            )
        out["pattern"] = f"^{_JSON_STRING_CHARACTER}{{{low},{'' if high is None else high}}}$"
    return out


def _length_bound(schema: dict, key: str, default: int | None) -> int | None:
    """Pop ``schema[key]``, which JSON Schema requires to be a non-negative integer."""
    if key not in schema:
        return default
    value = schema.pop(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type: 3.0 is the integer 3
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GrammarError(
            f"structured.json_schema: {key} must be a non-negative integer, got {value!r}"
        )
    return value


def cache_key(params: StructuredOutputParams) -> tuple[str, bytes]:
    """A spec's cache key: its kind and a digest of its canonical text, so a
    key costs 32 bytes however large the spec."""
    kind, value = params.key()
    return kind, hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()
