"""Speculative decoding in the worker: the n-gram proposer and draft verification."""
from tokenbudget.worker.spec_decode.ngram import NgramProposer
from tokenbudget.worker.spec_decode.rejection import SeedRewind, num_accepted

__all__ = ["NgramProposer", "SeedRewind", "num_accepted"]
