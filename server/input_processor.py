"""Prompts in, token ids out (and token ids back to text, incrementally)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenbudget.core.request import MultiModalFeature

Prompt = str | dict[str, Any]


class InputProcessor:
    """Tokenizes and validates the prompt forms of ``LLM.generate`` and the server:
    a string, ``{"prompt_token_ids": [...]}``, ``{"messages": [...]}`` (chat,
    images as bytes or PIL images) or ``{"prompt": str, "images": [...]}``."""

    def __init__(self, tokenizer: Any, vocab_size: int, model_path: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._model_path = model_path
        self._mm_processor = None

    @classmethod
    def from_pretrained(cls, path: str, *, vocab_size: int | None = None,
                        trust_remote_code: bool = False) -> InputProcessor:
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if vocab_size is None:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            vocab_size = config.get_text_config().vocab_size
        return cls(tokenizer, vocab_size, path)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def process(self, prompt: Prompt) -> tuple[list[int], list[MultiModalFeature]]:
        token_ids, features = self._tokenize(prompt)
        self.validate(token_ids)
        return token_ids, features

    def _tokenize(self, prompt: Prompt) -> tuple[list[int], list[MultiModalFeature]]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), []
        if not isinstance(prompt, dict):
            raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError("prompt_token_ids must be a list of ints")
            return list(ids), []
        if "messages" in prompt:
            messages = prompt["messages"]
            if _has_images(messages):
                return self.mm_processor.process_messages(messages)
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False), []
        if "prompt" in prompt:
            images = prompt.get("images") or []
            if images:
                return self.mm_processor.process_prompt(prompt["prompt"], images)
            return self._tokenize(prompt["prompt"])
        raise ValueError("prompt dict needs one of 'prompt_token_ids', 'messages' or 'prompt'; "
                         f"got keys {sorted(prompt)}")

    @property
    def mm_processor(self):
        if self._mm_processor is None:
            try:
                from tokenbudget.server.mm_processor import MultiModalProcessor
            except ImportError as exc:
                raise ValueError("images need tokenbudget.server.mm_processor") from exc
            if self._model_path is None:
                raise ValueError("images need an InputProcessor made by from_pretrained")
            self._mm_processor = MultiModalProcessor.from_pretrained(self._model_path)
        return self._mm_processor

    def validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: token id {t!r} is not an integer in "
                                 f"[0, {self.vocab_size}) (the model's vocabulary)")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens)


def _has_images(messages: Any) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
               for m in messages)


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids, never splitting a UTF-8 character.

    A byte-level token may hold part of a character; decoding it alone gives
    U+FFFD. We hold such tails back until the next token completes them, and
    decode a short window (from ``prefix_offset``) rather than the whole text.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (maybe empty)."""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever was held back, as is."""
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        delta = self._decode(self.token_ids[self._prefix_offset:])[len(prefix):]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
