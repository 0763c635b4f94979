"""The tiny checkpoint builders: Qwen special tokens, chat template, loadable weights."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenbudget.server.testing.tiny_models import QWEN_SPECIAL_TOKENS, build_tiny_qwen3


def test_tokenizer_keeps_qwen_special_tokens_whole(tiny_qwen3_path):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    for special in QWEN_SPECIAL_TOKENS:
        ids = tok(special, add_special_tokens=False).input_ids
        assert ids == [tok.convert_tokens_to_ids(special)], special
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Hello café 東京 🙂"
    assert tok.decode(tok(text).input_ids) == text


def test_chat_template_renders_text_and_image_parts(tiny_qwen3_path):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tiny_qwen3_is_deterministic_and_eos_is_im_end(tiny_qwen3_path, tmp_path):
    again = build_tiny_qwen3(tmp_path / "again", seed=0)
    a = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path)
    b = AutoModelForCausalLM.from_pretrained(again)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert a.config.vocab_size >= len(tok)
    assert a.config.eos_token_id == tok.eos_token_id == a.generation_config.eos_token_id
