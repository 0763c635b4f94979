"""Random rows sample exactly softmax(logits / temperature)."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.sampler import Sampler, SamplingMetadata, make_generator

NUM_DRAWS = 20000
# Eight tokens, the rarest at ~1.3%: every expected count is well above 5.
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.2, 0.3])


def _expected(temperature: float) -> dict[int, float]:
    probs = torch.softmax(LOGITS.double() / temperature, dim=-1)
    return dict(enumerate(probs.tolist()))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_draws_follow_tempered_softmax(temperature, assert_matches_distribution):
    torch.manual_seed(1234)
    params = [SamplingParams(temperature=temperature)] * NUM_DRAWS
    md = SamplingMetadata.from_params(params, [None] * NUM_DRAWS, "cpu")
    tokens = Sampler()(LOGITS.expand(NUM_DRAWS, -1), md).sampled_token_ids
    assert_matches_distribution(tokens, _expected(temperature))


def test_seeded_draws_follow_softmax_across_seeds(assert_matches_distribution):
    # One row per seed: the per-request generator path must be an exact sampler too.
    n = 5000
    params = [SamplingParams(temperature=0.5, seed=s) for s in range(n)]
    generators = [make_generator(s, "cpu") for s in range(n)]
    md = SamplingMetadata.from_params(params, generators, "cpu")
    tokens = Sampler()(LOGITS.expand(n, -1), md).sampled_token_ids
    assert_matches_distribution(tokens, _expected(0.5))


def test_random_rows_mixed_with_greedy_rows_follow_softmax(assert_matches_distribution):
    # Random rows are gathered out of a mixed batch and written back to their own positions.
    torch.manual_seed(99)
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0) for i in range(NUM_DRAWS)]
    md = SamplingMetadata.from_params(params, [None] * NUM_DRAWS, "cpu")
    tokens = Sampler()(LOGITS.expand(NUM_DRAWS, -1), md).sampled_token_ids
    greedy = torch.tensor([p.temperature == 0.0 for p in params])
    assert torch.all(tokens[greedy] == LOGITS.argmax())
    assert_matches_distribution(tokens[~greedy], _expected(1.0))
