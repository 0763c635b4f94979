"""Sampling one step's logits rows and assembling each request's tokens and
logprobs (ModelRunner's second half, after the forward).

Each sampling request has 1 + drafts logits rows, in scheduled order; a
request verifying drafts keeps the accepted ones and the token after them.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from tokenbudget.core.outputs import SchedulerOutput
from tokenbudget.worker.fault_isolation import StepPart
from tokenbudget.worker.input_batch import InputBatch, RequestState, StepInputs, TokenHistory
from tokenbudget.worker.sampler import NO_TOKEN, Sampler, SamplingMetadata, apply_token_bitmask
from tokenbudget.worker.spec_decode import SeedRewind, aligned_drafts, num_accepted


def sample(
    sampler: Sampler,
    requests: dict[str, RequestState],
    batch: InputBatch,
    device: torch.device,
    so: SchedulerOutput,
    step: StepInputs,
    logits: torch.Tensor,
):
    """Returns (request index per logits row, token ids, logprob (ids, values) or None,
    the seeded generators to rewind after verification)."""
    samplers = np.flatnonzero(step.samples)
    row_req = np.repeat(samplers, step.num_drafts[samplers] + 1)
    rewind = SeedRewind()
    if len(row_req) == 0:
        return row_req, [], None, rewind
    states = [requests[step.req_ids[i]] for i in row_req]
    if so.grammar_bitmask is not None:
        apply_grammar(so, step, row_req, logits)
    metadata = SamplingMetadata.from_params(
        [s.sampling_params for s in states],
        [s.generator for s in states],
        device,
        _token_history(batch, step, row_req, states),
        [s.eos_token_id for s in states],
    )
    for row, generator in metadata.generators.items():
        # Seeded random rows only: greedy rows draw nothing.
        i = int(row_req[row])
        if step.num_drafts[i] and (row == 0 or row_req[row - 1] != i):
            rewind.save(i, generator)
    result = sampler(logits.float(), metadata)
    ids = result.sampled_token_ids.tolist()
    if NO_TOKEN in ids:
        # A ValueError: fault isolation ends the request(s) with this row, as
        # INVALID_ARGUMENT, and the step's other requests go on.
        raise ValueError(
            "sampling_params: no token is allowed at this step (allowed_token_ids, "
            "bad_words, min_tokens and the structured output exclude every token)"
        )
    lps = None
    if result.logprobs is not None:
        lps = (result.logprobs_token_ids.tolist(), result.logprobs.tolist())
    return row_req, ids, lps, rewind


def _token_history(
    batch: InputBatch, step: StepInputs, row_req: np.ndarray, states: list[RequestState]
) -> TokenHistory:
    """What each logits row has seen: row t of a request verifying drafts has seen the
    first t of them as output, as if it had sampled them."""
    # row_req is sorted, so searchsorted finds each request's first row.
    num_drafts_seen = np.arange(len(row_req)) - np.searchsorted(row_req, row_req)
    num_prompt = np.fromiter((s.num_prompt_tokens for s in states), np.int64, len(states))
    return batch.history(step.rows[row_req], num_prompt, num_drafts_seen)


def apply_grammar(
    so: SchedulerOutput, step: StepInputs, row_req: np.ndarray, logits: torch.Tensor
) -> None:
    """Bitmask rows come per structured request (1 + drafts rows each, in
    structured_req_ids order); map them onto our logits rows."""
    bitmask = so.grammar_bitmask
    if isinstance(bitmask, Future):
        # Deferred by the engine until the previous step's tokens are
        # accepted; the forward pass ran meanwhile.
        bitmask = bitmask.result()
    bitmask = np.asarray(bitmask)
    if len(row_req) == len(step.req_ids) and so.structured_req_ids == step.req_ids:
        # Every request samples one row and all are constrained, in order.
        apply_token_bitmask(logits, torch.from_numpy(bitmask))
        return
    first_row = {}
    for j, i in enumerate(row_req):
        first_row.setdefault(step.req_ids[i], j)
    src, dst, k = [], [], 0
    for rid in so.structured_req_ids:
        # Rows per request: 1 + its drafts, whether or not this run computes it.
        n = len(so.scheduled_spec_decode_tokens.get(rid, ())) + 1
        if rid in first_row:
            src.extend(range(k, k + n))
            dst.extend(range(first_row[rid], first_row[rid] + n))
        k += n
    if not dst:
        return
    if src != list(range(len(bitmask))):
        bitmask = bitmask[src]
    if dst == list(range(len(row_req))):
        # Every sampled row is constrained, in order: mask in place.
        apply_token_bitmask(logits, torch.from_numpy(bitmask))
        return
    dst_t = torch.tensor(dst, device=logits.device)
    rows = logits.index_select(0, dst_t)
    apply_token_bitmask(rows, torch.from_numpy(bitmask))
    logits.index_copy_(0, dst_t, rows)


def collect(
    requests: dict[str, RequestState],
    device: torch.device,
    so: SchedulerOutput,
    step: StepInputs,
    row_req: np.ndarray,
    ids: list[int],
    lps,
    rewind: SeedRewind,
    vocab: int,
) -> StepPart:
    """Each request's kept tokens (and logprobs), in ``step.req_ids`` order."""
    sampled: list[list[int]] = [[] for _ in step.req_ids]
    logprobs: list | None = None
    if lps is not None:
        logprobs = [None] * len(step.req_ids)
    samplers = np.flatnonzero(step.samples)
    num_rows = step.num_drafts[samplers] + 1
    num_kept = num_rows
    if len(samplers) and step.num_drafts[samplers].any():
        spec = so.scheduled_spec_decode_tokens
        drafts = aligned_drafts(num_rows, [spec.get(step.req_ids[i]) for i in samplers])
        num_kept = num_accepted(np.asarray(ids), drafts, num_rows) + 1
    j = 0
    for i, n, kept in zip(samplers.tolist(), num_rows.tolist(), num_kept.tolist()):
        tokens = ids[j : j + kept]
        if rewind:
            rewind.rewind(i, n, kept, (vocab,), device)
        sampled[i] = tokens
        state = requests[step.req_ids[i]]
        if lps is not None and state.sampling_params.logprobs is not None:
            width = state.sampling_params.logprobs + 1
            logprobs[i] = [
                dict(zip(lps[0][j + t][:width], lps[1][j + t][:width])) for t in range(kept)
            ]
        j += n
    return StepPart(step.req_ids, sampled, logprobs, None)
