"""The n-gram proposer against a naive reference: the longest suffix (between
prompt_lookup_min and prompt_lookup_max tokens) that occurred earlier, its most
recent occurrence, and the k tokens that followed it (copying on through the
drafts themselves when the occurrence runs into the sequence's end)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbudget.worker.spec_decode import NgramProposer


def reference(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        suffix = seq[len(seq) - n :]
        # Occurrences ending at p, most recent first; p < the last position.
        for p in range(len(seq) - 2, n - 2, -1):
            if seq[p - n + 1 : p + 1] == suffix:
                out = list(seq)
                for j in range(k):
                    out.append(out[p + 1 + j])
                return out[len(seq) :]
    return []


def propose(proposer: NgramProposer, seqs: list[list[int]]) -> list[list[int]]:
    # Rows of a batch array with junk past each sequence's end, in a shuffled row order.
    width = max(len(s) for s in seqs) + 8
    table = np.random.default_rng(1).integers(0, 5, size=(len(seqs) + 3, width))
    rows = np.random.default_rng(2).permutation(len(seqs) + 3)[: len(seqs)]
    for r, s in zip(rows, seqs):
        table[r, : len(s)] = s
    return proposer.propose(table, rows, np.array([len(s) for s in seqs]))


@pytest.mark.parametrize("k, lo, hi", [(4, 2, 5), (3, 1, 1), (5, 3, 3), (1, 1, 4)])
def test_batched_proposals_equal_the_naive_reference(k, lo, hi):
    rng = np.random.default_rng(0)
    # Small alphabets so matches of every length occur; lengths 1..60 in one batch.
    seqs = [
        rng.integers(0, rng.integers(2, 6), size=rng.integers(1, 60)).tolist() for _ in range(300)
    ]
    got = propose(NgramProposer(k, lo, hi), seqs)
    assert got == [reference(s, k, lo, hi) for s in seqs]
    assert sum(map(bool, got)) > 100  # the cases exercise matches, not just misses


def test_longest_match_wins_then_the_most_recent_occurrence():
    proposer = NgramProposer(3, 1, 3)
    # "7 8" occurs twice; "6 7 8" once (the earlier one): the longer match wins.
    assert propose(proposer, [[6, 7, 8, 1, 2, 3, 9, 7, 8, 4, 5, 0, 6, 7, 8]]) == [[1, 2, 3]]
    # Two occurrences of "7 8" of equal length: the most recent one.
    assert propose(proposer, [[7, 8, 1, 2, 3, 7, 8, 4, 5, 6, 9, 7, 8]]) == [[4, 5, 6]]


def test_a_periodic_run_copies_on_through_its_own_drafts():
    # The most recent match of "1 2" overlaps the end: drafts continue the period.
    assert propose(NgramProposer(5, 2, 2), [[9, 1, 2, 1, 2]]) == [[1, 2, 1, 2, 1]]
    assert propose(NgramProposer(4, 1, 3), [[5, 5]]) == [[5, 5, 5, 5]]


def test_no_proposal_below_prompt_lookup_min_or_for_fresh_tokens():
    assert propose(NgramProposer(3, 3, 5), [[1, 2, 3, 9, 2, 3]]) == [[]]  # only "2 3" repeats
    assert propose(NgramProposer(3, 1, 5), [[1, 2, 3, 4], [7]]) == [[], []]
