"""Prompt forms, validation errors, and streaming detokenization."""

from __future__ import annotations

import random

import pytest

from tokenbudget.server.engine.input_processor import IncrementalDetokenizer, InputProcessor


@pytest.fixture(scope="module")
def processor(tiny_qwen3_path) -> InputProcessor:
    return InputProcessor.from_pretrained(tiny_qwen3_path)


def test_prompt_forms_tokenize_like_the_tokenizer(processor):
    tok = processor.tokenizer
    assert processor.process("Hello world") == (tok.encode("Hello world"), [])
    assert processor.process({"prompt_token_ids": [9, 10, 11]}) == ([9, 10, 11], [])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    rendered = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert processor.process({"messages": messages})[0] == tok.encode(
        rendered, add_special_tokens=False
    )


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": []}, "prompt_token_ids must not be empty"),
        ({"prompt_token_ids": [1, 10**6]}, r"prompt_token_ids: token id 1000000 is not an integer"),
        ({"prompt_token_ids": [1, -1]}, r"prompt_token_ids: token id -1"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of ints"),
        ({"text": "hi"}, "prompt dict needs one of"),
        (42, "prompt must be a str or a dict"),
    ],
)
def test_bad_prompts_raise_errors_naming_the_field(processor, prompt, message):
    with pytest.raises(ValueError, match=message):
        processor.process(prompt)


def test_streamed_text_deltas_never_split_a_character(processor):
    text = "Straße 東京 こんにちは 🙂🚀 done"
    ids = processor.tokenizer.encode(text)
    # Byte-level BPE splits the rare characters across tokens.
    assert any("\ufffd" in processor.decode([t]) for t in ids)
    detok = processor.detokenizer()
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text


def test_flush_emits_a_dangling_partial_character(processor):
    ids = processor.tokenizer.encode("🙂")
    assert len(ids) > 1
    detok = processor.detokenizer()
    assert detok.add(ids[:-1]) == ""
    assert detok.flush() == processor.decode(ids[:-1])


def _reference_text(tokenizer, ids, skip, spaces):
    """transformers' slow-tokenizer decode: added tokens and the runs between them
    decoded apart, joined with spaces when asked."""
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    subs, run = [], []
    for t in ids:
        if t in added:
            if skip and added[t].special:
                continue
            if run:
                subs.append(tokenizer.decode(run, skip_special_tokens=skip))
                run = []
            subs.append(added[t].content)
        else:
            run.append(t)
    if run:
        subs.append(tokenizer.decode(run, skip_special_tokens=skip))
    return (" " if spaces else "").join(subs)


@pytest.mark.parametrize(
    "skip, spaces", [(True, False), (False, False), (False, True), (True, True)]
)
def test_incremental_text_equals_a_full_decode_on_random_byte_fragments(processor, skip, spaces):
    """Random ids split characters across tokens and mix in special tokens; fed one
    at a time or in bursts, the deltas add up to the full decode (with
    spaces_between_special_tokens: the slow tokenizers' segment-wise decode)."""
    tok = processor.tokenizer
    rng = random.Random(7)
    specials = sorted(tok.added_tokens_decoder)
    for _ in range(150):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok))
            for _ in range(rng.randint(1, 30))
        ]
        detok = processor.detokenizer(
            skip_special_tokens=skip, spaces_between_special_tokens=spaces
        )
        pos, deltas = 0, []
        while pos < len(ids):
            burst = rng.choice((1, 1, 1, 3))
            deltas.append(detok.add(ids[pos : pos + burst]))
            pos += burst
        deltas.append(detok.flush())
        expected = (
            _reference_text(tok, ids, skip, spaces)
            if spaces
            else tok.decode(ids, skip_special_tokens=skip)
        )
        assert "".join(deltas) == detok.text == expected, ids


def test_window_fallback_matches_the_decode_stream(processor):
    """Tokenizers without a tokenizers backend decode a window; same text."""

    class Slow:
        def __init__(self, tok):
            self._tok = tok
            self.added_tokens_decoder = tok.added_tokens_decoder

        def decode(self, ids, skip_special_tokens=True):
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(3)
    tok = processor.tokenizer
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 25))]
        fast = processor.detokenizer(skip_special_tokens=False)
        slow = IncrementalDetokenizer(Slow(tok), skip_special_tokens=False)
        a = [fast.add([t]) for t in ids] + [fast.flush()]
        b = [slow.add([t]) for t in ids] + [slow.flush()]
        assert "".join(a) == "".join(b) == tok.decode(ids, skip_special_tokens=False)
