"""apply_token_bitmask: xgrammar's kernel and the torch fallback agree with the bit layout."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker import sampler
from tokenbudget.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_token_bitmask,
    apply_token_bitmask_torch,
)


def _random_bitmask(rows: int, vocab: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = (torch.rand(rows, (vocab + 31) // 32 * 32, generator=g) < density).long()
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    # Reinterpret as signed int32: bit 31 set gives a negative word, as xgrammar writes them.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bit j of word w allows token 32*w + j, read one token at a time."""
    words = bitmask.tolist()
    return torch.tensor(
        [[(row[t // 32] & 0xFFFFFFFF) >> (t % 32) & 1 == 1 for t in range(vocab)] for row in words]
    )


@pytest.mark.parametrize("vocab", [96, 100])  # a multiple of 32, and a ragged last word
def test_torch_fallback_and_xgrammar_kernel_match_the_bit_layout(vocab):
    logits = torch.randn(6, vocab)
    bitmask = _random_bitmask(6, vocab, density=0.5, seed=vocab)
    allowed = _reference_allowed(bitmask, vocab)
    expected = torch.where(allowed, logits, float("-inf"))

    fallback, kernel, dispatched = logits.clone(), logits.clone(), logits.clone()
    apply_token_bitmask_torch(fallback, bitmask)
    xgrammar.apply_token_bitmask_inplace(kernel, bitmask, vocab_size=vocab)
    apply_token_bitmask(dispatched, bitmask)
    for masked in (fallback, kernel, dispatched):
        assert torch.equal(masked, expected)
    # On CPU float logits the dispatch takes apply_token_bitmask_cpu (tested
    # against xgrammar's kernel in tests/structured); xgrammar never failed here.
    assert "cpu" not in sampler._XGRAMMAR_UNAVAILABLE


def test_disallowed_tokens_are_never_sampled():
    vocab, rows = 200, 3000
    torch.manual_seed(5)
    logits = torch.randn(rows, vocab) * 2
    bitmask = _random_bitmask(rows, vocab, density=0.1, seed=1)
    allowed = _reference_allowed(bitmask, vocab)
    apply_token_bitmask(logits, bitmask)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.99),
    ]
    params = [kinds[i % 3] for i in range(rows)]
    md = SamplingMetadata.from_params(params, [None] * rows, "cpu")
    tokens = Sampler()(logits, md).sampled_token_ids
    assert torch.all(allowed[torch.arange(rows), tokens])


def test_bitmask_too_narrow_for_the_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="bitmask covers 64 tokens but logits have 100"):
        apply_token_bitmask(torch.zeros(2, 100), torch.full((2, 2), -1, dtype=torch.int32))
