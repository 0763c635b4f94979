"""Shared helpers for the sampler tests (as fixtures: test modules cannot import each other)."""

from __future__ import annotations

import math

import pytest
import torch

torch.set_num_threads(1)

# Chi-square critical values at p = 0.001 (df -> value), from standard tables: a correct sampler
# fails one of these checks once in a thousand seeds; the seeds below are fixed.
CHI2_CRITICAL_P001 = {
    1: 10.83,
    2: 13.82,
    3: 16.27,
    4: 18.47,
    5: 20.52,
    6: 22.46,
    7: 24.32,
    8: 26.12,
    9: 27.88,
    10: 29.59,
}


def chi_square(tokens: torch.Tensor, probs: dict[int, float]) -> tuple[float, int]:
    """Pearson's statistic of sampled `tokens` against `probs` (token -> probability).

    Returns (statistic, degrees of freedom). A token outside `probs` makes the statistic inf.
    """
    counts: dict[int, int] = {}
    for t in tokens.tolist():
        counts[t] = counts.get(t, 0) + 1
    if set(counts) - set(probs):
        return math.inf, len(probs) - 1
    n = tokens.numel()
    stat = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())
    return stat, len(probs) - 1


@pytest.fixture
def assert_matches_distribution():
    def check(tokens: torch.Tensor, probs: dict[int, float]) -> None:
        stat, df = chi_square(tokens, probs)
        assert stat < CHI2_CRITICAL_P001[df], (
            f"chi-square {stat:.2f} >= {CHI2_CRITICAL_P001[df]} (df={df})"
        )

    return check
