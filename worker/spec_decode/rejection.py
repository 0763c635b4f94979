"""Verifying draft tokens so that the target distribution is kept exactly.

A request verifying k drafts d_1..d_k gets k + 1 logits rows: row t is the
target model's distribution p_t after the sequence extended by d_1..d_t. The
sampler draws one token x_t from each processed row (penalties, logits
processors, temperature, top-k/top-p/min-p, grammar mask: whatever a plain
step would apply, with d_1..d_t counted as already generated). Draft d_{t+1}
is accepted while x_t == d_{t+1}; the first row whose draw differs emits its
draw, and when all k drafts are accepted row k emits the bonus token.

This is rejection sampling for a draft distribution that is a point mass at
d: acceptance happens with probability p_t(d), and given rejection the
emitted token is a draw from p_t conditioned on not being d, i.e. p_t with d
removed and renormalised. So each emitted token has exactly the
distribution plain decoding would give it. With greedy rows (argmax) it is
"accept the longest prefix agreeing with the model, plus the model's next token".

Per-request seeds: a seeded row draws its randomness from the request's own
generator, one fixed-size draw per row. Row t of a verification step uses
the draw a plain step would use for the same output position, so after
rewinding the generator past the rows that were thrown away
(``SeedRewind``) a seeded request samples the very same tokens with or
without drafts.
"""

from __future__ import annotations

import numpy as np
import torch


def num_accepted(sampled: np.ndarray, drafts: np.ndarray, num_rows: np.ndarray) -> np.ndarray:
    """Accepted drafts per request. ``sampled``: the token drawn from every row,
    requests' rows back to back (``num_rows[i]`` = drafts + 1 each); ``drafts``:
    aligned with ``sampled``, the draft each row verifies (-1 on each request's
    last row, which has none)."""
    starts = np.cumsum(num_rows) - num_rows
    # Each request's first row whose draw differs from its draft; its last row always does.
    position = np.where(sampled != drafts, np.arange(len(sampled)), len(sampled))
    return np.minimum.reduceat(position, starts) - starts


def aligned_drafts(num_rows: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """The draft each row verifies, for ``num_accepted``: request i's drafts (``num_rows[i]
    - 1`` of them) then -1 on its last row."""
    aligned = np.full(int(num_rows.sum()), -1, np.int64)
    first = np.cumsum(num_rows) - num_rows
    for j, d in zip(first.tolist(), drafts):
        if d:
            aligned[j : j + len(d)] = d
    return aligned


class SeedRewind:
    """Seeded requests that verify drafts: their generators' states before the
    step, to set them back to "after one draw per emitted token"."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def save(self, request_index: int, generator: torch.Generator) -> None:
        self._saved[request_index] = (generator, generator.get_state())

    def rewind(
        self,
        request_index: int,
        num_rows: int,
        num_emitted: int,
        row_shape: tuple[int, ...],
        device: torch.device,
    ) -> None:
        """The sampler drew one ``row_shape`` float32 uniform block per row; keep only
        the first ``num_emitted`` draws' worth of consumed randomness."""
        saved = self._saved.get(request_index)
        if saved is None or num_emitted == num_rows:
            return
        generator, state = saved
        generator.set_state(state)
        scratch = torch.empty(row_shape, dtype=torch.float32, device=device)
        for _ in range(num_emitted):
            scratch.uniform_(generator=generator)

    def __bool__(self) -> bool:
        return bool(self._saved)
