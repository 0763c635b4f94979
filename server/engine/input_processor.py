"""Prompts in, token ids out (token ids back to text, incrementally:
server/engine/detokenizer.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tokenbudget.core.request import MultiModalFeature
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.server.engine.detokenizer import IncrementalDetokenizer
from tokenbudget.server.engine.mm_processor import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST,
)
from tokenbudget.server.engine.request_limits import RequestLimits

Prompt = str | dict[str, Any]

# Unicode normalization (NFC, NFKC) can shorten text before it is tokenized:
# composing a Hangul syllable from its three jamo turns 9 UTF-8 bytes into 3.
_NORMALIZER_SHRINK = 3
# Tokens tokenized beyond truncate_prompt_tokens when only a tail of a long
# text is tokenized: the first tokens of a cut text may differ from those of
# the whole, and these absorb the difference.
_TAIL_SLACK_TOKENS = 16


class InputProcessor:
    """Tokenizes and validates the prompt forms of ``LLM.generate`` and the server:
    a string, ``{"prompt_token_ids": [...]}``, ``{"messages": [...]}`` (chat,
    images as bytes or PIL images; optional ``"chat_template"`` and
    ``"add_generation_prompt"`` for text chats) or ``{"prompt": str, "images": [...]}``."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        model_path: str | None = None,
        *,
        max_logprobs: int | None = None,
        max_model_len: int | None = None,
        max_prompt_bytes: int | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_image_pixels_per_request: int = DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST,
        max_images_per_prompt: int | None = None,
        request_limits: RequestLimits | None = None,
    ) -> None:
        """``max_logprobs``: the most (prompt) logprobs a request may ask for
        (vLLM's engine argument; None: up to the vocabulary size).

        ``max_prompt_bytes``: a text prompt (after its chat template) longer
        than this in UTF-8 bytes is refused before it is tokenized, or, with
        ``truncate_prompt_tokens``, only a tail that holds those tokens is
        tokenized. None: ``max_model_len`` times the tokenizer's longest
        token in bytes (times 3 when it normalizes Unicode), the shortest text
        that can never fit (no limit while ``max_model_len`` is None; the
        AsyncEngine sets it). The pixel and image-count limits: see mm_processor.
        ``request_limits``: the bounds on stop strings, bad words and
        structured specs (default: RequestLimits' defaults)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_logprobs = vocab_size if max_logprobs is None else max_logprobs
        self.max_model_len = max_model_len
        if max_prompt_bytes is not None and (
            isinstance(max_prompt_bytes, bool)
            or not isinstance(max_prompt_bytes, int)
            or max_prompt_bytes < 1
        ):
            raise ValueError(f"max_prompt_bytes must be an integer >= 1, got {max_prompt_bytes!r}")
        self._max_prompt_bytes = max_prompt_bytes
        self._max_token_bytes: int | None = None
        self.max_image_pixels = max_image_pixels
        self.max_image_pixels_per_request = max_image_pixels_per_request
        self.max_images_per_prompt = max_images_per_prompt
        self.request_limits = request_limits or RequestLimits()
        self._model_path = model_path
        self._mm_processor = None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        vocab_size: int | None = None,
        trust_remote_code: bool = False,
        tokenizer: str | None = None,
        revision: str | None = None,
        chat_template: str | None = None,
        max_logprobs: int | None = None,
        **limits: Any,
    ) -> InputProcessor:
        """``tokenizer``: another folder or hub id for the tokenizer (default:
        ``path`` at ``revision``); ``chat_template`` replaces the tokenizer's own;
        ``limits``: ``__init__``'s max_model_len, max_prompt_bytes and pixel limits."""
        from transformers import AutoTokenizer

        from tokenbudget.core.utils.model_source import load_config, load_or_explain

        # revision names a version of the model's repository, not of another tokenizer's.
        source, tok_revision = (path, revision) if tokenizer is None else (tokenizer, None)
        tok = load_or_explain(
            lambda: AutoTokenizer.from_pretrained(
                source, trust_remote_code=trust_remote_code, revision=tok_revision
            ),
            source,
            what="tokenizer",
            flag="--tokenizer" if tokenizer else "--model",
            revision=tok_revision,
        )
        if chat_template is not None:
            tok.chat_template = chat_template
        if vocab_size is None:
            config = load_config(path, revision=revision, trust_remote_code=trust_remote_code)
            vocab_size = config.get_text_config().vocab_size
        return cls(tok, vocab_size, path, max_logprobs=max_logprobs, **limits)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def process(
        self, prompt: Prompt, truncate_prompt_tokens: int | None = None
    ) -> tuple[list[int], list[MultiModalFeature]]:
        token_ids, features = self._tokenize(prompt, truncate_prompt_tokens)
        if truncate_prompt_tokens is not None and len(token_ids) > truncate_prompt_tokens:
            token_ids, features = _keep_last(token_ids, features, truncate_prompt_tokens)
        self.validate(token_ids)
        return token_ids, features

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Check ``params``' token ids against the vocabulary and tokenize its
        bad words; returns the params to use (a copy when something was added).
        The request limits are checked first, before anything is tokenized."""
        self.request_limits.check(params)
        vocab = self.vocab_size
        ids = {
            "stop_token_ids": params.stop_token_ids,
            "logit_bias": list(params.logit_bias or ()),
            "allowed_token_ids": params.allowed_token_ids or (),
        }
        for i, seq in enumerate(params.bad_words_token_ids or ()):
            ids[f"bad_words_token_ids[{i}]"] = seq
        for name, values in ids.items():
            bad = next((t for t in values if t >= vocab), None)
            if bad is not None:
                raise ValueError(
                    f"{name}: token id {bad} is outside the model's vocabulary [0, {vocab})"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be <= the vocabulary size {vocab}, got {value}")
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name} must be <= max_logprobs ({self.max_logprobs}, the "
                    f"server's limit), got {value}"
                )
        if not params.bad_words:
            return params
        # Like vLLM: each word as is and after a space (most BPEs fold a leading
        # space into the first token, so both forms are banned). One batch call
        # tokenizes them all; a dict keeps the first of each duplicate, in order.
        texts = [t for w in params.bad_words for t in (w.lstrip(), " " + w.lstrip())]
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        sequences = dict.fromkeys(tuple(s) for s in params.bad_words_token_ids or [])
        sequences.update(dict.fromkeys(tuple(s) for s in encoded if s))
        return dataclasses.replace(params, bad_words_token_ids=[list(s) for s in sequences] or None)

    # -- prompt length before tokenizing ----------------------------------------------
    @property
    def max_prompt_bytes(self) -> int | None:
        """The prompt bytes tokenized at most (see __init__); None: no limit."""
        if self._max_prompt_bytes is not None:
            return self._max_prompt_bytes
        if self.max_model_len is None:
            return None
        return self.max_model_len * self.max_token_bytes

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token can stand for (times 3 when
        the tokenizer normalizes Unicode): computed once, on first use."""
        if self._max_token_bytes is None:
            tok = self.tokenizer
            pieces = tok.batch_decode(
                [[i] for i in range(len(tok))],
                skip_special_tokens=False,
                clean_up_tokenization_spaces=False,
            )
            # A piece of a byte-level UTF-8 character decodes to U+FFFD (3
            # bytes): an overestimate, which only raises the limit.
            longest = max((len(p.encode()) for p in pieces), default=1)
            backend = getattr(tok, "backend_tokenizer", None)
            normalizes = backend is None or backend.normalizer is not None
            self._max_token_bytes = max(longest, 1) * (_NORMALIZER_SHRINK if normalizes else 1)
        return self._max_token_bytes

    def _encode(
        self,
        text: str,
        field: str,
        truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Tokenize a prompt text, refusing one too long to tokenize (or, with
        truncate_prompt_tokens, tokenizing only a tail that holds them)."""
        limit = self.max_prompt_bytes
        # UTF-8 takes at most 4 bytes a character: most texts pass without encoding.
        if limit is None or len(text) * 4 <= limit or len(text.encode()) <= limit:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if truncate_prompt_tokens is None:
            raise ValueError(
                f"{field}: the prompt is {len(text.encode())} bytes, more than max_prompt_bytes="
                f"{limit} (it cannot fit in max_model_len={self.max_model_len} tokens; set "
                "truncate_prompt_tokens to keep its end)"
                if self._max_prompt_bytes is None
                else f"{field}: the prompt is {len(text.encode())} bytes, more than "
                f"max_prompt_bytes={limit} (the server's limit; set truncate_prompt_tokens to "
                "keep its end)"
            )
        # A tail of c characters holds at least c / max_token_bytes tokens.
        keep = min(truncate_prompt_tokens, self.max_model_len or truncate_prompt_tokens)
        tail = text[-(keep + _TAIL_SLACK_TOKENS) * self.max_token_bytes :]
        return self.tokenizer.encode(tail, add_special_tokens=False)

    def _tokenize(
        self, prompt: Prompt, truncate_prompt_tokens: int | None = None
    ) -> tuple[list[int], list[MultiModalFeature]]:
        if isinstance(prompt, str):
            return self._encode(
                prompt, "prompt", truncate_prompt_tokens, add_special_tokens=True
            ), []
        if not isinstance(prompt, dict):
            raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError("prompt_token_ids must be a list of ints")
            if (
                truncate_prompt_tokens is None
                and self.max_model_len is not None
                and len(ids) > self.max_model_len
            ):
                raise ValueError(
                    f"prompt_token_ids: the prompt has {len(ids)} tokens, more "
                    f"than max_model_len={self.max_model_len}"
                )
            return list(ids), []
        if "messages" in prompt:
            messages = prompt["messages"]
            if _has_images(messages):
                return self.mm_processor.process_messages(messages)
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                chat_template=prompt.get("chat_template"),
                add_generation_prompt=prompt.get("add_generation_prompt", True),
            )
            return self._encode(text, "messages", truncate_prompt_tokens), []
        if "prompt" in prompt:
            images = prompt.get("images") or []
            if images:
                return self.mm_processor.process_prompt(prompt["prompt"], images)
            return self._tokenize(prompt["prompt"], truncate_prompt_tokens)
        raise ValueError(
            "prompt dict needs one of 'prompt_token_ids', 'messages' or 'prompt'; "
            f"got keys {sorted(prompt)}"
        )

    @property
    def mm_processor(self):
        if self._mm_processor is None:
            from tokenbudget.server.engine.mm_processor import MultiModalProcessor

            if self._model_path is None:
                raise ValueError("images need an InputProcessor made by from_pretrained")
            # Images cannot be cut by truncation: their prompts are never tokenized in part.
            self._mm_processor = MultiModalProcessor.from_pretrained(
                self._model_path,
                max_image_pixels=self.max_image_pixels,
                max_image_pixels_per_request=self.max_image_pixels_per_request,
                max_images_per_prompt=self.max_images_per_prompt,
                encode=self._encode,
            )
        return self._mm_processor

    def validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids: token id {t!r} is not an integer in "
                    f"[0, {self.vocab_size}) (the model's vocabulary)"
                )

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(
        self, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = False
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens, spaces_between_special_tokens
        )


def _keep_last(
    token_ids: list[int], features: list[MultiModalFeature], k: int
) -> tuple[list[int], list[MultiModalFeature]]:
    """truncate_prompt_tokens: the last ``k`` tokens; an image may not be cut."""
    cut = len(token_ids) - k
    kept = []
    for f in features:
        if f.offset < cut:
            raise ValueError(
                f"truncate_prompt_tokens={k} would cut image {f.mm_hash} out of "
                f"the prompt ({len(token_ids)} tokens); keep more tokens"
            )
        kept.append(dataclasses.replace(f, offset=f.offset - cut))
    return token_ids[cut:], kept


def _has_images(messages: Any) -> bool:
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
        for m in messages
    )
