"""Draft verification (worker/spec_decode/rejection.py) keeps the target distribution.

Each request verifies two point-mass drafts d1, d2 over fixed rows p0, p1, p2 (what the
model would give after the prompt, after d1, after d1 d2). The emitted tokens must follow
the exact law of plain sampling: [a] with p0(a) for a != d1, [d1, b] with p0(d1) p1(b) for
b != d2, [d1, d2, c] with p0(d1) p1(d2) p2(c). A chi-square test at p = 0.001 (a correct
verifier fails once in a thousand seeds; the seeds here are fixed) checks it, and the same
check rejects wrong acceptance rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.sampler import Sampler, SamplingMetadata, make_generator
from tokenbudget.worker.spec_decode import num_accepted

LOGITS = torch.tensor(
    [
        [1.0, 0.2, -0.5, 0.6],  # p0
        [0.1, 1.2, 0.4, -1.0],  # p1, after d1
        [-0.3, 0.5, 0.9, 0.0],
    ]
)  # p2, after d1 d2
DRAFTS = [0, 2]  # d1 is p0's likeliest token, d2 an unlikely one under p1
NUM_REQUESTS = 20000


def exact_law(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The law of the emitted tokens, from the rows the sampler actually samples
    (temperature and top-k applied), worked out by hand."""
    x = LOGITS.double() / params.temperature
    if params.top_k > 0:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1).tolist()
    d1, d2 = DRAFTS
    law = {(a,): p[0][a] for a in range(4) if a != d1}
    law.update({(d1, b): p[0][d1] * p[1][b] for b in range(4) if b != d2})
    law.update({(d1, d2, c): p[0][d1] * p[1][d2] * p[2][c] for c in range(4)})
    return {cell: q for cell, q in law.items() if q > 0}


def emitted(params: SamplingParams, verify, seeded: bool = False) -> list[tuple[int, ...]]:
    n = NUM_REQUESTS // 4 if seeded else NUM_REQUESTS
    generators = [None] * (3 * n)
    if seeded:  # one generator per request, shared by its three rows
        for i in range(n):
            generators[3 * i : 3 * i + 3] = [make_generator(1000 + i, "cpu")] * 3
    torch.manual_seed(7)
    md = SamplingMetadata.from_params([params] * (3 * n), generators, "cpu")
    sampled = Sampler()(LOGITS.repeat(n, 1), md).sampled_token_ids.numpy()
    drafts = np.tile(DRAFTS + [-1], n)
    kept = verify(sampled, drafts, np.full(n, 3)) + 1
    return [tuple(sampled[3 * i : 3 * i + k]) for i, k in enumerate(kept.tolist())]


def chi_square(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if set(counts) - set(law):
        return float("inf")  # a sequence the exact law never emits
    n = len(samples)
    return sum((counts.get(c, 0) - n * q) ** 2 / (n * q) for c, q in law.items())


# Chi-square critical values at p = 0.001 by degrees of freedom (standard tables).
CRITICAL = {6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}

CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
]


@pytest.mark.parametrize("params", CASES, ids=["t1", "t0.7", "t1-top3"])
@pytest.mark.parametrize("seeded", [False, True], ids=["global", "seeded"])
def test_verified_drafts_follow_the_exact_law_of_plain_sampling(params, seeded):
    law = exact_law(params)
    stat = chi_square(emitted(params, num_accepted, seeded), law)
    assert stat < CRITICAL[len(law) - 1], f"chi-square {stat:.1f}, df {len(law) - 1}"


def always_accept(sampled, drafts, num_rows):
    return num_rows - 1


def accept_the_first_then_verify(sampled, drafts, num_rows):
    # Trusts d1 blindly (shifting mass from [a] onto [d1, ...]), then verifies d2.
    return 1 + (sampled[1::3] == drafts[1::3]).astype(np.int64)


@pytest.mark.parametrize("wrong", [always_accept, accept_the_first_then_verify])
def test_the_check_rejects_a_wrong_acceptance_rule(wrong):
    params = CASES[0]
    law = exact_law(params)
    assert chi_square(emitted(params, wrong), law) > CRITICAL[len(law) - 1]


def test_greedy_rows_accept_the_longest_agreeing_prefix_plus_the_next_token():
    sampled = np.array([5, 6, 9, 4, 1, 2, 3, 8, 7])
    drafts = np.array([5, 6, 7, -1, 1, -1, 0, 9, -1])
    assert num_accepted(sampled, drafts, np.array([4, 2, 3])).tolist() == [2, 1, 0]
