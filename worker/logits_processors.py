"""Logits processors that change which token a row may pick, in vLLM's order: allowed_token_ids,
bad words, logit_bias, then the repetition, frequency and presence penalties. Temperature and
the top-k / top-p / min-p filters come after them, in the sampler.

``LogitsProcessors.build`` turns one step's params and token history into device tensors, each
feature only when some row uses it; a batch that uses none gets None and pays one pass over its
params. ``apply`` works on a copy, so the sampler's logprobs stay those of the logits as given
(vLLM's default, raw logprobs).

The penalties touch only the tokens a row has seen: gather their logits, penalise, scatter them
back. That is [rows, history] work where masks would be [rows, vocab], and on a CPU boolean
masks and torch.where over a vocabulary cost more than the whole random draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.input_batch import TokenHistory

_NEG_INF = float("-inf")


@dataclass(slots=True)
class LogitsProcessors:
    """Per-step inputs of the processors; a None field is a feature no row uses."""

    # Rows restricted by allowed_token_ids, and the (row, token) pairs they allow.
    allowed_rows: torch.Tensor | None
    allowed: tuple[torch.Tensor, torch.Tensor] | None
    # (row, token) pairs that a bad word bans at this step.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # (row, token) pairs and the bias added to each.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    penalties: Penalties | None

    @classmethod
    def build(cls, params: list[SamplingParams], history: TokenHistory | None,
              device: torch.device | str) -> LogitsProcessors | None:
        used = [j for j, p in enumerate(params)
                if p.allowed_token_ids is not None or p.bad_words_token_ids or p.logit_bias
                or p.has_penalties]
        if not used:
            return None
        allowed = [j for j in used if params[j].allowed_token_ids is not None]
        biased = [j for j in used if params[j].logit_bias]
        penalised = [j for j in used if params[j].has_penalties]
        with_bad_words = [j for j in used if params[j].bad_words_token_ids]
        if history is None and (penalised or with_bad_words):
            raise ValueError("penalties and bad words need the rows' token history")
        banned = _bad_word_bans(params, with_bad_words, history)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        def pairs(rows: list[int], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            return (longs([j for j, ids in zip(rows, tokens) for _ in ids]),
                    longs([t for ids in tokens for t in ids]))

        bias = None
        if biased:
            rows, tokens = pairs(biased, [list(params[j].logit_bias) for j in biased])
            values = [b for j in biased for b in params[j].logit_bias.values()]
            bias = (rows, tokens, torch.tensor(values, dtype=torch.float32, device=device))
        return cls(
            allowed_rows=longs(allowed) if allowed else None,
            allowed=(pairs(allowed, [params[j].allowed_token_ids for j in allowed])
                     if allowed else None),
            banned=(longs([j for j, _ in banned]), longs([t for _, t in banned])) if banned else None,
            bias=bias,
            penalties=(Penalties.build(params, penalised, history, device)
                       if penalised else None),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A processed float32 copy of `logits` [rows, vocab]."""
        x = logits.to(torch.float32, copy=True)
        if self.allowed is not None:
            kept = x[self.allowed]
            x.index_fill_(0, self.allowed_rows, _NEG_INF)
            x.index_put_(self.allowed, kept)
        if self.banned is not None:
            x.index_put_(self.banned, torch.tensor(_NEG_INF, device=x.device))
        if self.bias is not None:
            rows, tokens, values = self.bias
            x.index_put_((rows, tokens), values, accumulate=True)
        if self.penalties is not None:
            self.penalties.apply(x)
        return x


def _bad_word_bans(params: list[SamplingParams], rows: list[int],
                   history: TokenHistory | None) -> list[tuple[int, int]]:
    """(row, token) pairs to ban: a word's last token, once the row's most recent output tokens
    are the rest of the word (vLLM's rule; prompt tokens do not count)."""
    banned = []
    for j in rows:
        output = history.output(j)
        for *prefix, last in params[j].bad_words_token_ids:
            start = len(output) - len(prefix)
            if start >= 0 and output[start:].tolist() == prefix:
                banned.append((j, last))
    return banned


@dataclass(slots=True)
class Penalties:
    """The repetition, frequency and presence penalties of the rows that use any of them.

    Within those rows a penalty a row does not use is neutral (1 or 0), which leaves its logits
    bit for bit unchanged, so one pass serves rows with different mixes.
    """

    rows: torch.Tensor | None  # [k] logits rows; None: every row, in order
    # Prompt and output ids, padded with the row's first token (a seen token: penalised once
    # either way, and duplicates write the same value); None: no row uses repetition.
    seen_ids: torch.Tensor | None  # [k, S]
    repetition: torch.Tensor  # [k, 1] float32
    # Output ids with weight 1, padding with weight 0; None: no row uses frequency or presence.
    output_ids: torch.Tensor | None  # [k, O]
    output_weights: torch.Tensor | None  # [k, O] float32
    frequency: torch.Tensor  # [k, 1] float32
    presence: torch.Tensor  # [k, 1] float32

    @classmethod
    def build(cls, params: list[SamplingParams], rows: list[int], history: TokenHistory,
              device: torch.device | str) -> Penalties:
        used = [params[j] for j in rows]
        index = np.asarray(rows)

        def column(name: str) -> torch.Tensor:
            values = [getattr(p, name) for p in used]
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        seen_ids = output_ids = output_weights = None
        if any(p.repetition_penalty != 1.0 for p in used):
            seen_ids = to_device(_seen_ids(history, index))
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in used):
            ids, weights = _output_ids(history, index)
            output_ids, output_weights = to_device(ids), to_device(weights)
        return cls(
            rows=None if len(rows) == len(history.rows) else to_device(index),
            seen_ids=seen_ids, repetition=column("repetition_penalty"),
            output_ids=output_ids, output_weights=output_weights,
            frequency=column("frequency_penalty"), presence=column("presence_penalty"))

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise `logits` [rows, vocab] in place."""
        x = logits if self.rows is None else logits.index_select(0, self.rows)
        if self.seen_ids is not None:
            _apply_repetition(x, self.seen_ids, self.repetition)
        if self.output_ids is not None:
            _apply_frequency_presence(x, self.output_ids, self.output_weights, self.frequency,
                                      self.presence)
        if self.rows is not None:
            logits.index_copy_(0, self.rows, x)


def _seen_ids(history: TokenHistory, index: np.ndarray) -> np.ndarray:
    """[k, S] every token rows `index` have seen, padded with each row's first token."""
    num_tokens = history.num_tokens[index]
    ids = history.token_ids[history.rows[index], :int(num_tokens.max())]
    return np.where(np.arange(ids.shape[1]) < num_tokens[:, None], ids, ids[:, :1])


def _output_ids(history: TokenHistory, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[k, O] the output tokens of rows `index` and their weights (1; 0 for padding).

    Padding reads whatever the batch holds after the output: weighted 0 it is not counted, so
    its token is either written back unchanged (count 0) or with the very value its counted
    occurrences write.
    """
    start, end = history.num_prompt_tokens[index], history.num_tokens[index]
    cols = start[:, None] + np.arange(int((end - start).max()))
    weights = (cols < end[:, None]).astype(np.float32)
    max_col = history.token_ids.shape[1] - 1
    return history.token_ids[history.rows[index][:, None], np.minimum(cols, max_col)], weights


def _apply_repetition(x: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the
    penalty when positive, multiplied when negative."""
    seen = x.gather(1, ids)
    # Branch-free, since torch.where is slow on a CPU; exact, since one term is always 0.
    penalised = seen.clamp(min=0).div_(penalty).add_(seen.clamp(max=0).mul_(penalty))
    x.scatter_(1, ids, penalised)


def _apply_frequency_presence(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                              frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """OpenAI's penalties: logit -= frequency * count + presence * (count > 0), over output."""
    counts = torch.zeros_like(x).scatter_add_(1, ids, weights).gather(1, ids)
    penalty = frequency * counts + presence * counts.clamp(max=1)
    x.scatter_(1, ids, x.gather(1, ids).sub_(penalty))
