"""The manager's bitmask rows against a naive oracle: with a choice list, a
token is allowed exactly when the text so far plus the token's bytes is still
a prefix of some choice (EOS once a choice is complete); ids past the
tokenizer (the model's padded vocabulary) and special tokens never are."""

from __future__ import annotations

import json

import numpy as np

from tokenbudget.core import Request, SamplingParams
from tokenbudget.core.structured.manager import StructuredOutputManager

CHOICES = ["yes", "no", "maybe so", "may"]


def _oracle(prefix: bytes, token_bytes: dict[int, bytes], eos: int) -> set[int]:
    choices = [c.encode() for c in CHOICES]
    allowed = {
        i for i, b in token_bytes.items() if b and any(c.startswith(prefix + b) for c in choices)
    }
    if prefix in choices:
        allowed.add(eos)
    return allowed


def _allowed(row: np.ndarray, vocab_size: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def _token(token_bytes: dict[int, bytes], piece: bytes) -> int:
    return next(i for i, b in token_bytes.items() if b == piece)


def _decoding(req: Request) -> None:
    req.num_computed_tokens = req.num_tokens - 1


def test_rows_match_the_naive_oracle_after_each_token(
    manager, ready_request, token_bytes, model_vocab_size
):
    req = ready_request("r", {"choice": CHOICES})
    eos = req.eos_token_id
    text = b""
    for piece in "maybe so":  # every byte is a token of a byte-level BPE
        _decoding(req)
        bitmask, ids = manager.grammar_bitmask({"r": req}, {"r": 1}, {})
        assert ids == ["r"] and bitmask.shape == (1, -(-model_vocab_size // 32))
        assert _allowed(bitmask[0], model_vocab_size) == _oracle(text, token_bytes, eos)
        token = _token(token_bytes, piece.encode())
        req.append_output_token_ids([token])
        assert not manager.accept_tokens(req, [token])
        text += piece.encode()
    _decoding(req)
    bitmask, _ = manager.grammar_bitmask({"r": req}, {"r": 1}, {})
    assert _allowed(bitmask[0], model_vocab_size) == {eos}
    assert manager.accept_tokens(req, [eos])  # the grammar's end finishes the request


def test_prefill_chunks_that_do_not_sample_get_no_row(manager, ready_request):
    req = ready_request("r", {"choice": CHOICES}, prompt_len=10)
    assert manager.grammar_bitmask({"r": req}, {"r": 6}, {}) == (None, [])
    req.num_computed_tokens = 6
    bitmask, ids = manager.grammar_bitmask({"r": req}, {"r": 4}, {})
    assert ids == ["r"] and bitmask.shape[0] == 1
    # Requests not scheduled this step get no row either.
    assert manager.grammar_bitmask({"r": req}, {"other": 4}, {}) == (None, [])


def test_draft_rows_follow_the_drafts_and_invalid_drafts_are_cut(
    manager, ready_request, token_bytes, model_vocab_size
):
    req = ready_request("r", {"choice": CHOICES})
    eos = req.eos_token_id
    valid = [_token(token_bytes, b"m"), _token(token_bytes, b"a")]
    invalid = _token(token_bytes, b"x")
    drafts = valid + [invalid, _token(token_bytes, b"b")]
    _decoding(req)
    bitmask, ids = manager.grammar_bitmask({"r": req}, {"r": 1 + len(drafts)}, {"r": drafts})
    assert ids == ["r"] and bitmask.shape[0] == 1 + len(drafts)
    for k, prefix in enumerate((b"", b"m", b"ma")):
        assert _allowed(bitmask[k], model_vocab_size) == _oracle(prefix, token_bytes, eos), k
    assert invalid not in _allowed(bitmask[2], model_vocab_size)  # the worker rejects it here
    # The matcher is back where it was; proposing drafts cuts at the first invalid one.
    assert manager.validate_drafts(req, drafts) == valid
    again, _ = manager.grammar_bitmask({"r": req}, {"r": 1}, {})
    assert (again[0] == bitmask[0]).all()


def test_rows_cover_the_model_vocab_and_padding_ids_are_never_allowed(
    manager, ready_request, tokenizer, model_vocab_size
):
    assert model_vocab_size > len(tokenizer)  # the tiny model pads its vocabulary
    req = ready_request("r", {"json_object": True})
    _decoding(req)
    bitmask, _ = manager.grammar_bitmask({"r": req}, {"r": 1}, {})
    allowed = _allowed(bitmask[0], model_vocab_size)
    assert allowed and max(allowed) < len(tokenizer)


def test_length_bounded_json_strings_reject_raw_control_characters(manager, tokenizer):
    # JSON forbids raw U+0000-U+001F inside strings; json.loads is the oracle.
    import xgrammar as xgr

    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 4}},
        "required": ["s"],
    }
    compiled = manager.compile(SamplingParams(structured={"json_schema": schema}).structured)
    # Raw control characters, then the same escaped (each escape is one character).
    verdicts = set()
    for text in (
        '{"s": "ab"}',
        '{"s": "abcde"}',
        '{"s": "a\tb"}',
        '{"s": "a\nb"}',
        '{"s": "\x00"}',
        '{"s": "\x1f"}',
        '{"s": "a\\tb"}',
        '{"s": "a\\nb"}',
        '{"s": "\\u0000"}',
        '{"s": "\\u001f\\t\\n\\r"}',
        '{"s": "\\t\\t\\t\\t\\t"}',
    ):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        accepted = matcher.accept_string(text) and matcher.is_terminated()
        try:
            valid = len(json.loads(text)["s"]) <= 4
        except json.JSONDecodeError:
            valid = False
        assert accepted == valid, text
        verdicts.add(valid)
    assert verdicts == {True, False}  # the oracle said both yes and no


def test_compiled_grammars_are_cached_by_spec_in_a_bounded_lru(tokenizer, model_vocab_size):
    manager = StructuredOutputManager(tokenizer, model_vocab_size, cache_size=2)
    specs = [SamplingParams(structured={"regex": f"[a-z]{{{n}}}"}).structured for n in (1, 2, 3)]
    first = manager._compiled(specs[0])
    assert manager._compiled(specs[0]) is first  # a hit compiles nothing
    manager._compiled(specs[1])
    manager._compiled(specs[0])  # refreshes specs[0]: specs[1] is now the oldest
    manager._compiled(specs[2])
    assert manager._compiled(specs[0]) is first
    assert len(manager._cache) == 2 and specs[1].key() not in manager._cache
    manager.shutdown()


def test_json_object_is_an_object_not_any_json_value(manager):
    # OpenAI's response_format json_object: a JSON object at the top level.
    import xgrammar as xgr

    compiled = manager.compile(SamplingParams(structured={"json_object": True}).structured)
    verdicts = {}
    for text in ('{"a": [1, 2], "b": {"c": null}}', "{}", "[1, 2]", '"text"', "42", "null"):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        verdicts[text] = matcher.accept_string(text) and matcher.is_terminated()
    assert verdicts == {text: isinstance(json.loads(text), dict) for text in verdicts}
