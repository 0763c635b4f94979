"""Greedy rows take the argmax; logprobs are log_softmax of the raw logits."""

from __future__ import annotations

import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.sampler import Sampler, SamplingMetadata

VOCAB = 500


def _sample(logits: torch.Tensor, params: list[SamplingParams]):
    md = SamplingMetadata.from_params(params, [None] * len(params), "cpu")
    return Sampler()(logits, md)


def test_all_greedy_batch_returns_argmax():
    logits = torch.randn(64, VOCAB)
    out = _sample(logits, [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.logprobs_token_ids is None


def test_greedy_rows_in_a_mixed_batch_return_argmax():
    logits = torch.randn(32, VOCAB)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=2) for i in range(32)]
    tokens = _sample(logits, params).sampled_token_ids
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))
    # The random rows sampled among their own top 2, not the greedy rows' answers.
    top2 = logits[0::2].topk(2, dim=-1).indices
    assert torch.all((top2 == tokens[0::2].unsqueeze(1)).any(dim=1))


def test_logprobs_are_log_softmax_of_raw_logits_at_sampled_and_top_ids():
    logits = torch.randn(24, VOCAB) * 3
    # Temperature and filters change what is sampled, never the reported logprobs.
    params = [
        SamplingParams(temperature=t, top_k=k, logprobs=n)
        for t, k, n in [(0.0, -1, 5), (0.5, 20, 2), (1.5, -1, None)] * 8
    ]
    out = _sample(logits, params)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs_token_ids.shape == out.logprobs.shape == (24, 6)
    assert torch.equal(out.logprobs_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprobs_token_ids[:, 1:], torch.topk(reference, 5).indices)
    expected = reference.gather(1, out.logprobs_token_ids)
    assert torch.allclose(out.logprobs, expected, atol=1e-6, rtol=0)


def test_zero_logprobs_returns_only_the_sampled_token():
    logits = torch.randn(4, VOCAB)
    out = _sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 4)
    assert out.logprobs_token_ids.shape == (4, 1)
    assert torch.allclose(out.logprobs[:, 0], torch.log_softmax(logits, -1).amax(-1), atol=1e-6)


def test_sampler_leaves_the_callers_logits_unchanged():
    logits = torch.randn(8, VOCAB)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, logprobs=1)] * 8
    _sample(logits, params)
    assert torch.equal(logits, before)


def test_empty_batch_samples_nothing():
    out = _sample(torch.empty(0, VOCAB), [])
    assert out.sampled_token_ids.shape == (0,)
