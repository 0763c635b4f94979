"""The n-gram (prompt lookup) proposer: draft tokens copied from the sequence itself.

After a step, for each request that sampled: find the longest n in
[prompt_lookup_min, prompt_lookup_max] such that the sequence's last n tokens
occurred earlier in prompt + output, and propose the k tokens that followed
that occurrence.

Which occurrence: the most recent. What a request repeats (a passage it is
quoting back, the current cycle of a loop) is usually its latest copy, and
the latest match is the one whose continuation most likely still agrees.
When the continuation runs into the sequence's end (a match overlapping the
suffix, as in a periodic run "a b a b a b"), the copy goes on through the
tokens it just proposed, like an LZ77 back-reference, so a period shorter
than k still yields k drafts.

The search is vectorised over the batch in numpy: one pass per suffix
position (prompt_lookup_max passes) over a [requests, longest sequence]
array marks where the suffix's last i tokens match, so its cost is
O(prompt_lookup_max * requests * length) in a few vector operations, with
no Python loop over requests or positions.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, rows: np.ndarray,
                num_tokens: np.ndarray) -> list[list[int]]:
        """Drafts for sequences ``token_ids[rows[b], :num_tokens[b]]`` (at most k each;
        empty where no suffix of at least prompt_lookup_min tokens occurred before)."""
        if len(rows) == 0:
            return []
        lengths = np.asarray(num_tokens, dtype=np.int64)
        width = int(lengths.max())
        if width < self.min_n + 1:
            return [[] for _ in range(len(rows))]
        seqs = token_ids[np.asarray(rows)[:, None], np.arange(width)]  # [B, W]
        index = np.arange(len(rows))
        # match[b, p]: how many tokens ending at position p equal the last tokens
        # of sequence b (capped at max_n); candidates end before the last token.
        ends = width - 1
        run = np.ones((len(rows), ends), dtype=bool)
        match = np.zeros((len(rows), ends), dtype=np.int32)
        for i in range(min(self.max_n, ends)):
            last = seqs[index, np.maximum(lengths - 1 - i, 0)][:, None]
            run[:, i:] &= seqs[:, :ends - i] == last
            run[:, :i] = False
            match += run
        # Positions at or past a sequence's last token are not earlier occurrences.
        match[np.arange(ends)[None, :] >= (lengths - 1)[:, None]] = 0
        best = match.max(axis=1)
        # The most recent position holding the longest match.
        end = ends - 1 - np.argmax((match == best[:, None])[:, ::-1], axis=1)
        period = lengths - 1 - end  # tokens after the match up to the sequence's end
        offsets = np.arange(self.k)[None, :] % np.maximum(period, 1)[:, None]
        drafts = seqs[index[:, None], end[:, None] + 1 + offsets]
        found = best >= self.min_n
        return [drafts[b].tolist() if found[b] else [] for b in range(len(rows))]
