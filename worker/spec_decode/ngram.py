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

The search is vectorised over the batch in numpy, with no Python loop over
requests or positions: one pass over the [requests, longest sequence] ids
finds the earlier positions holding each sequence's last token; only those
candidates are extended backwards, up to prompt_lookup_max - 1 more
comparisons each; a segmented max picks each sequence's longest, most recent
match. Cost: O(requests * length) once plus O(candidates * prompt_lookup_max)
(about 50 us for 4 sequences of 300 tokens, 0.2 ms for 64 of 512 and 1.2 ms
for 256 of 1024 on one CPU core; benchmarks/spec_decode.py reports it per step).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(
        self, token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray
    ) -> list[list[int]]:
        """Drafts for sequences ``token_ids[rows[b], :num_tokens[b]]`` (at most k each;
        empty where no suffix of at least prompt_lookup_min tokens occurred before)."""
        num = len(rows)
        drafts: list[list[int]] = [[] for _ in range(num)]
        if num == 0:
            return drafts
        rows = np.asarray(rows, dtype=np.int64)
        lengths = np.asarray(num_tokens, dtype=np.int64)
        ends = int(lengths.max()) - 1  # candidates end before a sequence's last token
        if ends < self.min_n:
            return drafts
        last = token_ids[rows, lengths - 1]
        # Candidates: earlier positions p holding the last token (one pass over the batch).
        b, p = np.nonzero(token_ids[rows, :ends] == last[:, None])  # sorted by b, then p
        # Positions at or past a shorter sequence's last token hold stale ids.
        before_last = p < lengths[b] - 1
        if not before_last.all():
            b, p = b[before_last], p[before_last]
        if len(b) == 0:
            return drafts
        # Extend each candidate's match backwards, up to max_n tokens.
        seq_rows, seq_last = rows[b], lengths[b] - 1
        length = np.ones(len(b), dtype=np.int64)
        alive = np.ones(len(b), dtype=bool)
        for i in range(1, self.max_n):
            alive &= p >= i
            alive[alive] = (
                token_ids[seq_rows[alive], p[alive] - i]
                == token_ids[seq_rows[alive], seq_last[alive] - i]
            )
            length += alive
        # Per sequence: the longest match, then the most recent one.
        key = length * (ends + 1) + p
        starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
        best = np.maximum.reduceat(key, starts)
        seq, best_len, end = b[starts], best // (ends + 1), best % (ends + 1)
        found = best_len >= self.min_n
        seq, end = seq[found], end[found]
        if len(seq) == 0:
            return drafts
        period = lengths[seq] - 1 - end  # tokens after the match up to the sequence's end
        offsets = np.arange(self.k)[None, :] % period[:, None]
        proposed = token_ids[rows[seq][:, None], end[:, None] + 1 + offsets]
        for i, d in zip(seq.tolist(), proposed.tolist()):
            drafts[i] = d
        return drafts
