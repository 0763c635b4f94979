"""Logits processors that change which token a row may pick, in vLLM's order:
allowed_token_ids, bad words and min_tokens (a row below min_tokens may not pick
its EOS or stop ids), logit_bias, then the repetition, frequency and presence
penalties. Temperature and the top-k / top-p / min-p filters come after them, in the sampler.

``LogitsProcessors.build`` turns one step's params and token history into device tensors, each
feature only when some row uses it; a batch that uses none gets None and pays one pass over its
params. ``apply`` works on a copy, so the sampler's logprobs stay those of the logits as given
(vLLM's default, raw logprobs).

The penalties touch only the tokens a row has seen: gather their logits, penalise, scatter them
back. That is [rows, history] work where vLLM's masks are [rows, vocab] (and boolean masks and
torch.where over [rows, vocab] are slow on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

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
    # (row, token) pairs that a bad word or min_tokens bans at this step.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # (row, token) pairs and the bias added to each.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    penalties: Penalties | None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        history: TokenHistory | None,
        device: torch.device | str,
        eos_token_ids: list[int | None] | None = None,
    ) -> LogitsProcessors | None:
        used = [
            j
            for j, p in enumerate(params)
            if p.has_penalties
            or p.logit_bias
            or p.allowed_token_ids is not None
            or p.bad_words_token_ids
            or p.min_tokens
        ]
        if not used:
            return None
        allowed, biased, penalised, with_bad_words, with_min = [], [], [], [], []
        for j in used:
            p = params[j]
            if p.allowed_token_ids is not None:
                allowed.append(j)
            if p.logit_bias:
                biased.append(j)
            if p.has_penalties:
                penalised.append(j)
            if p.bad_words_token_ids:
                with_bad_words.append(j)
            if p.min_tokens:
                with_min.append(j)
        if history is None and (penalised or with_bad_words or with_min):
            raise ValueError("penalties, bad words and min_tokens need the rows' token history")

        def pairs(rows: list[int], tokens: list) -> tuple[torch.Tensor, torch.Tensor]:
            counts = [len(t) for t in tokens]
            return (
                _to_device(np.repeat(rows, counts), device),
                _to_device(np.fromiter(chain.from_iterable(tokens), np.int64, sum(counts)), device),
            )

        bias = None
        if biased:
            maps = [params[j].logit_bias for j in biased]
            values = np.fromiter(chain.from_iterable(m.values() for m in maps), np.float32)
            bias = (*pairs(biased, maps), _to_device(values, device))
        banned = _bad_word_bans(params, with_bad_words, history)
        banned += _min_tokens_bans(params, with_min, history, eos_token_ids)
        return cls(
            allowed_rows=_to_device(np.array(allowed), device) if allowed else None,
            allowed=(
                pairs(allowed, [params[j].allowed_token_ids for j in allowed]) if allowed else None
            ),
            banned=pairs([j for j, _ in banned], [[t] for _, t in banned]) if banned else None,
            bias=bias,
            penalties=(Penalties.build(params, penalised, history, device) if penalised else None),
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


def _bad_word_bans(
    params: list[SamplingParams], rows: list[int], history: TokenHistory | None
) -> list[tuple[int, int]]:
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


def _min_tokens_bans(
    params: list[SamplingParams],
    rows: list[int],
    history: TokenHistory | None,
    eos_token_ids: list[int | None] | None,
) -> list[tuple[int, int]]:
    """(row, token) pairs to ban: a row with fewer than min_tokens outputs may not stop, so its
    EOS and stop ids are masked (vLLM's rule; the length limits still apply)."""
    banned = []
    for j in rows:
        num_output = int(history.num_tokens[j] - history.num_prompt_tokens[j])
        if num_output >= params[j].min_tokens:
            continue
        eos = eos_token_ids[j] if eos_token_ids is not None else None
        stops = params[j].stop_token_ids if eos is None else [eos, *params[j].stop_token_ids]
        banned += [(j, t) for t in dict.fromkeys(stops)]
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
    def build(
        cls,
        params: list[SamplingParams],
        rows: list[int],
        history: TokenHistory,
        device: torch.device | str,
    ) -> Penalties:
        index = np.asarray(rows)
        values = np.array(
            [
                (
                    params[j].repetition_penalty,
                    params[j].frequency_penalty,
                    params[j].presence_penalty,
                )
                for j in rows
            ],
            np.float32,
        )
        columns = torch.from_numpy(values).to(device, non_blocking=True).unsqueeze(2)
        seen_ids = output_ids = output_weights = None
        if (values[:, 0] != 1.0).any():
            seen_ids = _to_device(_seen_ids(history, index), device)
        if values[:, 1:].any():
            ids, weights = _output_ids(history, index)
            output_ids, output_weights = _to_device(ids, device), _to_device(weights, device)
        return cls(
            rows=None if len(rows) == len(history.rows) else _to_device(index, device),
            seen_ids=seen_ids,
            repetition=columns[:, 0],
            output_ids=output_ids,
            output_weights=output_weights,
            frequency=columns[:, 1],
            presence=columns[:, 2],
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise `logits` [rows, vocab] in place."""
        x = logits if self.rows is None else logits.index_select(0, self.rows)
        if self.seen_ids is not None:
            _apply_repetition(x, self.seen_ids, self.repetition)
        if self.output_ids is not None:
            _apply_frequency_presence(
                x, self.output_ids, self.output_weights, self.frequency, self.presence
            )
        if self.rows is not None:
            logits.index_copy_(0, self.rows, x)


def _to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def _seen_ids(history: TokenHistory, index: np.ndarray) -> np.ndarray:
    """[k, S] every token rows `index` have seen, padded with each row's first token."""
    lengths = history.num_tokens[index]
    # A copy (padded in place below) by numpy's fast path: rows of a column slice; a fancy
    # index together with a slice is ~4x slower.
    ids = history.token_ids[:, : int(lengths.max())][history.rows[index]]
    padding, counts = _padding(lengths, ids.shape[1])
    ids.reshape(-1)[padding] = np.repeat(ids[:, 0], counts)
    return ids


def _output_ids(history: TokenHistory, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[k, O] the output tokens of rows `index`, padded with each row's first token, and their
    weights: 1, and 0 for padding. Uncounted, a padding token is either written back unchanged
    (count 0) or with the very value its counted occurrences write."""
    token_ids, rows = history.token_ids, history.rows[index]
    start = history.num_prompt_tokens[index]
    lengths = history.num_tokens[index] - start
    flat = (rows * token_ids.shape[1] + start)[:, None] + np.arange(int(lengths.max()))
    # Padding may run past the array's end; it is overwritten below.
    ids = token_ids.reshape(-1).take(np.minimum(flat, token_ids.size - 1))
    weights = np.ones(ids.shape, np.float32)
    padding, counts = _padding(lengths, ids.shape[1])
    ids.reshape(-1)[padding] = np.repeat(token_ids[rows, 0], counts)
    weights.reshape(-1)[padding] = 0.0
    return ids, weights


def _padding(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of a [len(lengths), width] array at or past each row's length, and how
    many there are per row: O(padding) work, where a [rows, width] mask is O(rows * width)."""
    counts = width - lengths
    first = np.arange(len(lengths)) * width + lengths
    return np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum()), counts


def _apply_repetition(x: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the
    penalty when positive, multiplied when negative."""
    seen = x.gather(1, ids)
    # Branch-free, since torch.where is slow on a CPU; exact, since one term is always 0.
    penalised = seen.clamp(min=0).div_(penalty).add_(seen.clamp(max=0).mul_(penalty))
    x.scatter_(1, ids, penalised)


def _apply_frequency_presence(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """OpenAI's penalties: logit -= frequency * count + presence * (count > 0), over output.

    The output tokens' own columns of `x` count them, so there is no [rows, vocab] buffer to
    clear (39 MB at 64 rows of a 152k vocabulary): read their logits out, zero the columns,
    add the weights up, read the counts, write the penalised logits back."""
    logits = x.gather(1, ids)
    counts = x.scatter_(1, ids, 0.0).scatter_add_(1, ids, weights).gather(1, ids)
    penalty = torch.addcmul(frequency * counts, presence, counts.clamp(max=1))
    x.scatter_(1, ids, logits.sub_(penalty))
