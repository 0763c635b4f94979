"""Token ids back to text, incrementally: the text deltas of a stream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids, never splitting a UTF-8 character.

    A byte-level token may hold part of a character; such tails are held back
    until a later token completes them (``flush`` gives them as they are at
    the end). Fast tokenizers use the tokenizers library's ``DecodeStream``
    (about 10x cheaper per token than re-decoding a window); others decode a
    short window from ``prefix_offset``.

    ``spaces_between_special_tokens`` has the meaning transformers' slow
    tokenizers gave it (fast ones ignore it): added tokens (special or not,
    unless skipped) and the runs of ordinary tokens between them are decoded
    separately and joined with single spaces.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._deltas: list[str] = []
        # Token id -> its text, for the added tokens that split segments.
        self._added = (
            _added_tokens(tokenizer, skip_special_tokens) if spaces_between_special_tokens else {}
        )
        self._joined_any = False  # a sub-text was emitted: the next one needs a space
        self._segment_start = 0  # first id of the current run of ordinary tokens
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        self._new_segment()

    def _new_segment(self) -> None:
        self._segment_start = len(self.token_ids)
        self._prefix_offset = self._read_offset = self._segment_start
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (maybe empty)."""
        parts = []
        for token in token_ids:
            if token in self._added:
                parts.append(self._take_pending())
                parts.append((" " if self._joined_any else "") + self._added[token])
                self._joined_any = True
                self.token_ids.append(token)
                self._new_segment()
                continue
            if len(self.token_ids) == self._segment_start:
                if self._joined_any:
                    parts.append(" ")  # a run of ordinary tokens after an added token
                self._joined_any = bool(self._added)
            self.token_ids.append(token)
            if self._stream is None:
                parts.append(self._window_delta())
            else:
                piece = self._stream.step(self._backend, token)
                if piece:
                    parts.append(piece)
                    self._read_offset = len(self.token_ids)
        delta = "".join(parts)
        self._deltas.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._deltas)

    def _window_delta(self) -> str:
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of the stream: whatever was held back, as is."""
        delta = self._take_pending()
        self._deltas.append(delta)
        return delta

    def _take_pending(self) -> str:
        if self._read_offset == len(self.token_ids):
            return ""
        # Decode from the run's start so context-dependent decoders (a leading
        # space stripped at the start) see what the full decode sees.
        start = self._segment_start if self._stream is not None else self._prefix_offset
        prefix = self._decode(self.token_ids[start : self._read_offset])
        delta = self._decode(self.token_ids[start:])[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return delta


def _added_tokens(tokenizer: Any, skip_special_tokens: bool) -> dict[int, str]:
    """Added tokens that stand as sub-texts of their own (special ones only
    when they are not skipped)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {
        i: t.content
        for i, t in added.items()
        if not (skip_special_tokens and getattr(t, "special", False))
    }
