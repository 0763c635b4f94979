"""From the engine's RequestOutputs to what a caller sees of one sample:
token ids, text deltas, stop strings, finish and stop reasons.

Stop strings are matched here, on the detokenized text, because core has no
tokenizer. The sample then ends at once for its reader; the caller finishes
the request in the engine (``SampleState.stopped_by_string``), whose tokens
still in flight are dropped. Streamed text never shows characters that a stop
string could still cut: a sample holds back the longest end of its text that
is a proper prefix of one of its stop strings, and nothing more.

A sample the engine stopped at a stop token (its EOS or a ``stop_token_ids``
id) outputs that token's id but not its text, unless
``include_stop_str_in_output`` (vLLM's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.server.engine.stop_strings import StopStrings


@dataclass(slots=True)
class SampleDelta:
    """What one sample produced since the last look."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


class SampleState:
    """One sample (one of a request's ``n``): its detokenizer and stop strings.

    ``detokenizer`` is an IncrementalDetokenizer, or None for token ids only
    (then stop strings cannot be matched; the front refuses that pairing).
    ``stop_strings``: the request's StopStrings, shared by its samples
    (built here when not given). Only the text not yet handed out is kept
    (the cursor holds where the text is among the stop strings): growing one
    string per token would copy the whole text every token."""

    __slots__ = (
        "index",
        "detokenizer",
        "stop",
        "cursor",
        "include_stop",
        "min_tokens",
        "num_tokens",
        "finished",
        "stop_string",
        "_unsent",
        "_found",
        "_holdback",
    )

    def __init__(
        self,
        index: int,
        params: SamplingParams,
        detokenizer: Any | None,
        stop_strings: StopStrings | None = None,
    ) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.stop = params.stop if detokenizer is not None else []
        # Where the text is in the stop strings' automaton (fed every piece).
        self.cursor = (stop_strings or StopStrings(self.stop)).cursor() if self.stop else None
        self._found: tuple[int, str] | None = None  # a stop string ending in the last piece
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.finished = False
        self.stop_string: str | None = None  # the stop string that ended the sample
        self._unsent = ""  # text not handed out yet
        # A prefix of a stop string emitted too early could be cut later;
        # including the stop string, nothing emitted can be cut.
        self._holdback = bool(self.stop) and not self.include_stop

    @property
    def stopped_by_string(self) -> bool:
        """The engine has not finished this sample: the caller must."""
        return self.stop_string is not None

    def update(self, outputs: list[RequestOutput]) -> SampleDelta | None:
        """Fold this sample's outputs (oldest first) into one delta; None when
        nothing is new for the caller."""
        delta = SampleDelta(self.index, [], "")
        for out in outputs:
            if self.finished:
                break  # tokens sampled after a stop string, still in flight
            self._take(out, delta)
        held = self._held_back() if self._holdback and not self.finished else 0
        if held:
            delta.text, self._unsent = self._unsent[:-held], self._unsent[-held:]
        else:
            delta.text, self._unsent = self._unsent, ""
        if not (delta.token_ids or delta.text or delta.finish_reason):
            return None
        return delta

    def _take(self, out: RequestOutput, delta: SampleDelta) -> None:
        tokens = out.new_token_ids
        shown = tokens  # the tokens whose text is output
        if (
            out.finish_reason == "stop"
            and not isinstance(out.stop_reason, str)
            and tokens
            and not self.include_stop
        ):
            # The engine stopped at a stop token: EOS (no stop reason) or a stop_token_ids id.
            # As in vLLM its id is output, its text only with include_stop_str_in_output.
            # (A grammar's end, stop reason "grammar", is an ordinary token.)
            shown = tokens[:-1]
        if self.stop:
            kept = self._add_until_stop(shown)
            if self.stop_string is not None:
                tokens = kept
        elif self.detokenizer is not None:
            self._unsent += self.detokenizer.add(shown)  # handed out at the end of update
        self.num_tokens += len(tokens)
        delta.token_ids.extend(tokens)
        if out.logprobs is not None:
            delta.logprobs = (delta.logprobs or []) + list(out.logprobs[: len(tokens)])
        if (
            self.stop_string is None
            and out.finish_reason is not None
            and self.detokenizer is not None
        ):
            tail = self.detokenizer.flush()
            if tail:
                self._append(tail)
                if self.stop:
                    self._find_stop()
        if self.stop_string is not None:
            delta.finish_reason, delta.stop_reason = "stop", self.stop_string
            self.finished = True
        elif out.finish_reason is not None:
            delta.finish_reason, delta.stop_reason = out.finish_reason, out.stop_reason
            self.finished = True

    def _add_until_stop(self, tokens: list[int]) -> list[int]:
        """Detokenize one token at a time so a stop string ends the sample at
        the token that completed it; returns the tokens kept."""
        for k, token in enumerate(tokens):
            piece = self.detokenizer.add([token])
            if not piece:
                continue
            self._append(piece)
            # vLLM's rule: stop strings count only once min_tokens are out.
            if self.num_tokens + k + 1 > self.min_tokens and self._find_stop():
                return tokens[: k + 1]
        return tokens

    def _append(self, piece: str) -> None:
        self._unsent += piece
        if self.cursor is not None:
            self._found = self.cursor.feed(piece)

    def _find_stop(self) -> bool:
        """Whether a stop string ends in the last piece appended (the earliest
        starting one); on a hit cut the text there (after it if included)."""
        if self._found is None:
            return False
        start, s = self._found
        # What follows the cut is still unsent: hold-back kept a stop string's
        # start unsent, and what follows an included one is in the last piece.
        drop = self.cursor.num_chars - (start + len(s) if self.include_stop else start)
        if drop:
            self._unsent = self._unsent[:-drop]
        self.stop_string = s
        return True

    def _held_back(self) -> int:
        """Length of the longest end of the unsent text that begins some stop string."""
        return self.cursor.held_back(len(self._unsent))
