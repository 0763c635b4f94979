"""The worker's persistent batch: per-request token ids and block tables in
preallocated numpy rows, updated from SchedulerOutput deltas.

Rows let step preparation be a handful of fancy-indexing operations over the
whole batch instead of a Python loop per token. A row belongs to a request
while it holds KV blocks; a preempted request gives its row back but keeps its
``RequestState`` (sampling generator, multimodal data) for when it resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenbudget.core.request import MultiModalFeature
from tokenbudget.core.sampling_params import SamplingParams


@dataclass(slots=True)
class StepInputs:
    """Host-side inputs of one step (of the requests one run computes), in
    scheduled order: built by ModelRunner._prepare from the batch rows."""

    req_ids: list[str]
    rows: np.ndarray  # [B] batch rows
    query_lens: np.ndarray  # [B]
    starts: np.ndarray  # [B] num_computed_tokens
    num_drafts: np.ndarray  # [B]
    positions: np.ndarray  # [T]
    input_ids: np.ndarray  # [T]
    samples: np.ndarray  # [B] bool: this request samples this step


@dataclass(slots=True)
class RequestState:
    """What outlives preemption: sampling state and multimodal inputs."""

    req_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: Any = None  # torch.Generator for seeded sampling
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # M-RoPE (VL models): positions [3, num_prompt_tokens] and the decode offset.
    mrope_positions: Any = None
    mrope_delta: int = 0
    row: int | None = None  # None while preempted
    eos_token_id: int | None = None  # masked while below min_tokens


@dataclass(slots=True)
class TokenHistory:
    """The tokens each sampled row has seen, read in place from the batch: row j has seen
    ``token_ids[rows[j], :num_tokens[j]]``, whose first ``num_prompt_tokens[j]`` are its
    prompt and the rest its output."""

    token_ids: np.ndarray  # [capacity, max_len] the batch's own array (read only)
    rows: np.ndarray  # [n] batch row of each sampled row
    num_prompt_tokens: np.ndarray  # [n]
    num_tokens: np.ndarray  # [n]

    def output(self, j: int) -> np.ndarray:
        """Row j's output tokens (a view)."""
        row = self.rows[j]
        return self.token_ids[row, self.num_prompt_tokens[j] : self.num_tokens[j]]


class InputBatch:
    """Rows of token ids, token counts and block tables, grown on demand."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        # Tokens known to the worker: prompt + every token it sampled.
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return len(self.num_tokens)

    def add(
        self, token_ids: list[int], block_ids: list[int], output_token_ids: list[int] = ()
    ) -> int:
        """A row for a request with ``token_ids`` (its prompt, or all its tokens
        when resumed) followed by ``output_token_ids`` (outputs it already has:
        a disaggregated decode's first token, sampled by the prefill engine)."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        p = len(token_ids)
        n = p + len(output_token_ids)
        if n > self.max_model_len:
            raise ValueError(
                f"request has {n} tokens, more than max_model_len={self.max_model_len}"
            )
        self.token_ids[row, :p] = token_ids
        self.token_ids[row, p:n] = output_token_ids
        self.num_tokens[row] = n
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        return row

    def remove(self, row: int) -> None:
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError(f"block table overflow: {end} blocks > {self.block_table.shape[1]}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        n = int(self.num_tokens[row])
        # Tokens past max_model_len can be sampled only to be discarded by the
        # scheduler's length check; nothing will ever read them as inputs.
        keep = token_ids[: max(self.max_model_len - n, 0)]
        self.token_ids[row, n : n + len(keep)] = keep
        self.num_tokens[row] = n + len(token_ids)

    def history(
        self, rows: np.ndarray, num_prompt_tokens: np.ndarray, num_drafts_seen: np.ndarray
    ) -> TokenHistory:
        """What sampled rows of `rows` have seen. A row verifying drafts has seen the first
        `num_drafts_seen` of them as output: they sit right after the row's known tokens."""
        # Clipped like append_tokens: tokens past max_model_len were never stored.
        num_tokens = np.minimum(self.num_tokens[rows] + num_drafts_seen, self.token_ids.shape[1])
        return TokenHistory(self.token_ids, rows, num_prompt_tokens, num_tokens)

    def _grow(self) -> None:
        # Async scheduling can admit new requests before the worker hears that
        # finished ones left, so rows may briefly exceed max_num_seqs.
        old = self.capacity
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros_like(self.num_tokens)])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))
