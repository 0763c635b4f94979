"""Speculative decoding in the worker: the n-gram proposer and draft verification."""

from tokenbudget.worker.spec_decode.ngram import NgramProposer
from tokenbudget.worker.spec_decode.rejection import SeedRewind, aligned_drafts, num_accepted

__all__ = ["NgramProposer", "SeedRewind", "aligned_drafts", "num_accepted"]
