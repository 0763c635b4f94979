"""A seeded request's tokens depend only on its seed and its own logits."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.sampler import Sampler, SamplingMetadata, make_generator

VOCAB, STEPS, BATCH = 1000, 8, 16
# Flat enough logits (std 1 over 1000 tokens) that two different streams almost never agree.
TARGET_LOGITS = torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(0))

TARGETS = [
    SamplingParams(temperature=1.0, seed=42),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, seed=42),
]


def _neighbours(step: int) -> list[tuple[SamplingParams, torch.Generator | None]]:
    """Fifteen other rows: greedy, plain random, filtered, and seeded with other seeds."""
    kinds = [
        lambda i: (SamplingParams(temperature=0.0), None),
        lambda i: (SamplingParams(temperature=1.2), None),
        lambda i: (SamplingParams(temperature=0.9, top_k=5, top_p=0.5), None),
        lambda i: (
            SamplingParams(temperature=1.0, min_p=0.3, seed=i),
            make_generator(1000 * step + i, "cpu"),
        ),
    ]
    return [kinds[i % len(kinds)](i) for i in range(BATCH - 1)]


def _run_alone(target: SamplingParams, seed: int) -> list[int]:
    generator, tokens = make_generator(seed, "cpu"), []
    for step in range(STEPS):
        md = SamplingMetadata.from_params([target], [generator], "cpu")
        tokens.append(Sampler()(TARGET_LOGITS[step : step + 1], md).sampled_token_ids.item())
    return tokens


def _run_in_batch(target: SamplingParams, seed: int, row: int, all_random: bool) -> list[int]:
    torch.manual_seed(row)  # the unseeded rows' batch draw differs from run to run
    generator, tokens = make_generator(seed, "cpu"), []
    other_logits = torch.randn(STEPS, BATCH, VOCAB)
    for step in range(STEPS):
        rows = _neighbours(step)
        if all_random:
            rows = [
                (SamplingParams(temperature=0.8), None) if p.temperature == 0 else (p, g)
                for p, g in rows
            ]
        rows.insert(row, (target, generator))
        logits = other_logits[step].clone()
        logits[row] = TARGET_LOGITS[step]
        md = SamplingMetadata.from_params([p for p, _ in rows], [g for _, g in rows], "cpu")
        assert md.all_random == all_random
        tokens.append(Sampler()(logits, md).sampled_token_ids[row].item())
    return tokens


@pytest.mark.parametrize("target", TARGETS, ids=["temperature", "filtered"])
def test_seeded_request_gives_same_tokens_alone_and_at_any_row_of_a_batch(target):
    alone = _run_alone(target, seed=42)
    for row in (0, 7, BATCH - 1):
        for all_random in (False, True):
            assert _run_in_batch(target, 42, row, all_random) == alone, (row, all_random)


def test_seeded_request_repeats_across_runs_with_fresh_generators():
    assert _run_alone(TARGETS[0], seed=42) == _run_alone(TARGETS[0], seed=42)


def test_different_seeds_give_different_tokens():
    assert _run_alone(TARGETS[0], seed=42) != _run_alone(TARGETS[0], seed=43)
