"""top-k, top-p and min-p keep exactly the allowed set of a naive per-row reference, and sample
the renormalised distribution inside it."""

from __future__ import annotations

import math
import random

import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.sampler import Sampler, SamplingMetadata, make_generator


def allowed_probs(logits: list[float], p: SamplingParams) -> dict[int, float]:
    """Naive reference: token -> renormalised probability after top-k, then top-p, then min-p.

    Filters work on temperature-scaled logits and keep ties at each boundary.
    """
    scaled = [x / p.temperature for x in logits]
    keep = set(range(len(scaled)))
    if p.top_k > 0:
        kth = sorted(scaled, reverse=True)[min(p.top_k, len(scaled)) - 1]
        keep = {i for i in keep if scaled[i] >= kth}
    if p.top_p < 1.0:
        probs = _softmax(scaled, keep)
        mass, cut = 0.0, None
        for i in sorted(keep, key=lambda i: -scaled[i]):
            if mass >= p.top_p:
                break
            mass += probs[i]
            cut = scaled[i]
        keep = {i for i in keep if scaled[i] >= cut}
    if p.min_p > 0.0:
        probs = _softmax(scaled, keep)
        top = max(probs.values())
        keep = {i for i in keep if probs[i] >= p.min_p * top}
    return _softmax(scaled, keep)


def _softmax(scaled: list[float], keep: set[int]) -> dict[int, float]:
    top = max(scaled[i] for i in keep)
    weights = {i: math.exp(scaled[i] - top) for i in keep}
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}


FILTER_CASES = [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.0, top_k=100),  # larger than the vocabulary: no filter
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.05),  # keeps only the top token
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=2.0, min_p=0.5),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.7),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.95, min_p=0.1),
    SamplingParams(temperature=1.5, top_p=0.8, min_p=0.3),
    SamplingParams(temperature=1.0),
]


def test_filters_never_emit_tokens_outside_the_reference_set():
    vocab, repeats = 32, 1000
    rng = random.Random(7)
    torch.manual_seed(7)
    cases = [
        (p, [rng.gauss(0.0, 2.0) for _ in range(vocab)], seeded)
        for p in FILTER_CASES
        for seeded in (False, True)
    ]
    # Every case repeated, interleaved with greedy rows, seeded rows alongside unseeded ones.
    params, generators, logits = [], [], []
    for r in range(repeats):
        for c, (p, row, seeded) in enumerate(cases):
            params.append(p)
            generators.append(make_generator(r * 1000 + c, "cpu") if seeded else None)
            logits.append(row)
        params.append(SamplingParams(temperature=0.0, top_k=2))
        generators.append(None)
        logits.append(cases[r % len(cases)][1])
    logits_t = torch.tensor(logits)
    md = SamplingMetadata.from_params(params, generators, "cpu")
    tokens = Sampler()(logits_t, md).sampled_token_ids

    stride = len(cases) + 1
    for c, (p, row, seeded) in enumerate(cases):
        allowed = allowed_probs(row, p)
        emitted = set(tokens[c::stride].tolist())
        assert emitted <= set(allowed), f"{p} (seeded={seeded}) emitted {emitted - set(allowed)}"
        # Too strict a filter shows too: every allowed token with >= 1% mass turns up in 1000.
        likely = {t for t, q in allowed.items() if q >= 0.01}
        assert likely <= emitted, f"{p} (seeded={seeded}) never emitted {likely - emitted}"
    assert torch.equal(tokens[stride - 1 :: stride], logits_t[stride - 1 :: stride].argmax(dim=-1))


def test_filtered_rows_sample_the_renormalised_distribution(assert_matches_distribution):
    logits = [2.0, 1.8, 1.5, 1.2, 1.0, 0.4, 0.1, -0.3, -1.0, -2.0, 0.9, 0.7]
    p = SamplingParams(temperature=0.9, top_k=8, top_p=0.85, min_p=0.15)
    allowed = allowed_probs(logits, p)
    assert 4 <= len(allowed) < 8  # every filter bites: top-k, then top-p or min-p
    n = 20000
    torch.manual_seed(2024)
    md = SamplingMetadata.from_params([p] * n, [None] * n, "cpu")
    tokens = Sampler()(torch.tensor(logits).expand(n, -1), md).sampled_token_ids
    assert_matches_distribution(tokens, allowed)


def test_top_p_keeps_tokens_tied_at_the_boundary():
    # Four equal tokens hold 25% each: top_p=0.3 needs two, and keeps all four tied ones.
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, -5.0, -6.0]]).expand(4000, -1)
    p = SamplingParams(top_p=0.3)
    torch.manual_seed(0)
    md = SamplingMetadata.from_params([p] * 4000, [None] * 4000, "cpu")
    emitted = set(Sampler()(logits, md).sampled_token_ids.tolist())
    assert emitted == set(allowed_probs(logits[0].tolist(), p)) == {0, 1, 2, 3}
