"""Prompt forms, validation errors, and streaming detokenization."""
from __future__ import annotations

import pytest

from tokenbudget.server.input_processor import InputProcessor


@pytest.fixture(scope="module")
def processor(tiny_qwen3_path) -> InputProcessor:
    return InputProcessor.from_pretrained(tiny_qwen3_path)


def test_prompt_forms_tokenize_like_the_tokenizer(processor):
    tok = processor.tokenizer
    assert processor.process("Hello world") == (tok.encode("Hello world"), [])
    assert processor.process({"prompt_token_ids": [9, 10, 11]}) == ([9, 10, 11], [])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    rendered = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert processor.process({"messages": messages})[0] == tok.encode(rendered,
                                                                     add_special_tokens=False)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "prompt_token_ids must not be empty"),
    ({"prompt_token_ids": [1, 10**6]}, r"prompt_token_ids: token id 1000000 is not an integer"),
    ({"prompt_token_ids": [1, -1]}, r"prompt_token_ids: token id -1"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of ints"),
    ({"text": "hi"}, "prompt dict needs one of"),
    (42, "prompt must be a str or a dict"),
])
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
