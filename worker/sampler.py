"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Logits processors (allowed_token_ids, bad words, logit_bias, penalties; logits_processors.py)
run first, on a copy, for greedy and random rows alike.

Everything runs on the logits' device, vectorised over the batch; only the sampled ids (and the
requested logprobs) are meant to leave it. Filters compose as one cut-off logit per row: a row
keeps every token whose (temperature-scaled) logit is >= its cut-off, so ties at a boundary are
kept and no scatter back from sorted order is needed.

Random rows sample by the exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. per token
is an exact draw from probs. A seeded row draws its q from its own generator (V numbers per
step), so its token depends only on its generator and its own logits, never on its row index or
on the rest of the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.input_batch import TokenHistory
from tokenbudget.worker.logits_processors import LogitsProcessors

logger = logging.getLogger(__name__)

# Temperatures below this are treated as greedy (dividing by them overflows float32 logits).
_SAMPLING_EPS = 1e-5


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request generator on `device`, seeded. Streams differ between CPU and CUDA."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step sampling inputs for the rows that sample, built once per step by from_params.

    The [n] tensors are in batch-row order; entries of greedy rows are neutral and unused.
    """

    temperature: torch.Tensor  # [n] float32; 0 for greedy rows
    top_k: torch.Tensor | None  # [n] long; -1/0 = off; None when no random row uses top-k
    top_p: torch.Tensor | None  # [n] float32; None when every random row has 1.0
    min_p: torch.Tensor | None  # [n] float32; None when every random row has 0.0
    generators: dict[int, torch.Generator]  # batch row -> generator, seeded random rows only
    all_greedy: bool
    all_random: bool
    max_num_logprobs: int | None  # None: no row asked for logprobs
    # Derived on the host so that forward never syncs with the device to find them.
    random_rows: list[int] = field(default_factory=list)  # batch rows that sample randomly
    random_index: torch.Tensor | None = None  # random_rows on the device
    max_top_k: int = 0  # largest active top_k among random rows
    top_p_index: torch.Tensor | None = None  # positions *within random_rows* with top_p < 1
    processors: LogitsProcessors | None = None  # None: no row uses any

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        history: TokenHistory | None = None,
        eos_token_ids: list[int | None] | None = None,
    ) -> SamplingMetadata:
        """`history`: the rows' tokens, needed only when some row uses penalties, bad words or
        min_tokens; `eos_token_ids`: each row's EOS id (None: none, or ignore_eos)."""
        if len(generators) != len(params):
            raise ValueError(
                f"generators must have one entry per row ({len(params)}), got {len(generators)}"
            )
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _SAMPLING_EPS]
        sampled = [params[i] for i in random_rows]
        is_random = [False] * len(params)
        for i in random_rows:
            is_random[i] = True

        def row_values(name: str, neutral: float) -> list:
            return [getattr(p, name) if r else neutral for p, r in zip(params, is_random)]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        active_top_k = [p.top_k for p in sampled if p.top_k > 0]
        top_p_positions = [j for j, p in enumerate(sampled) if p.top_p < 1.0]
        wanted_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=tensor(row_values("temperature", 0.0), torch.float32),
            top_k=tensor(row_values("top_k", -1), torch.long) if active_top_k else None,
            top_p=tensor(row_values("top_p", 1.0), torch.float32) if top_p_positions else None,
            min_p=(
                tensor(row_values("min_p", 0.0), torch.float32)
                if any(p.min_p > 0 for p in sampled)
                else None
            ),
            generators={i: generators[i] for i in random_rows if generators[i] is not None},
            all_greedy=not random_rows,
            all_random=len(random_rows) == len(params),
            max_num_logprobs=max(wanted_logprobs) if wanted_logprobs else None,
            random_rows=random_rows,
            random_index=tensor(random_rows, torch.long),
            max_top_k=max(active_top_k, default=0),
            top_p_index=tensor(top_p_positions, torch.long) if top_p_positions else None,
            processors=LogitsProcessors.build(params, history, device, eos_token_ids),
        )


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [n] long, on the device
    logprobs_token_ids: torch.Tensor | None  # [n, k+1] long: sampled token, then the top-k ids
    logprobs: torch.Tensor | None  # [n, k+1] float32: log_softmax of the raw logits at those ids


# What a row with no allowed token samples (the step then fails that request).
NO_TOKEN = -1


class Sampler(torch.nn.Module):
    """Samples one token per row. Never modifies `logits` (apply bitmasks before calling)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # Logprobs stay those of `logits` as given: the processors work on a copy.
        processed = logits if metadata.processors is None else metadata.processors.apply(logits)
        private = processed is not logits  # a float32 copy: temperature may scale it in place
        # A row whose every token is banned (allowed_token_ids, bad words, min_tokens,
        # a grammar) samples NO_TOKEN instead of an arbitrary banned one.
        best, sampled = processed.max(dim=-1)
        blocked = best == float("-inf")
        if metadata.all_random:
            sampled = _sample_random(processed, metadata, in_place=private)
        elif not metadata.all_greedy:
            sampled.index_copy_(
                0,
                metadata.random_index,
                _sample_random(
                    processed.index_select(0, metadata.random_index), metadata, in_place=private
                ),
            )
        sampled = sampled.masked_fill_(blocked, NO_TOKEN)
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None)
        ids, logprobs = _gather_logprobs(logits, sampled.clamp(min=0), metadata.max_num_logprobs)
        return SamplerOutput(sampled, ids, logprobs)


def _sample_random(logits: torch.Tensor, md: SamplingMetadata, in_place: bool) -> torch.Tensor:
    """Token ids for the random rows; `logits` holds exactly those rows, in random_rows order.
    `in_place`: `logits` is a private float32 copy that may be overwritten."""
    rows = None if md.all_random else md.random_index

    def select(values: torch.Tensor | None) -> torch.Tensor | None:
        return values if values is None or rows is None else values.index_select(0, rows)

    # Otherwise a fresh float32 tensor: the caller's logits stay untouched for logprobs.
    temperature = select(md.temperature).unsqueeze(1)
    x = logits.div_(temperature) if in_place else logits / temperature
    cutoff = _cutoff_logits(
        x, select(md.top_k), md.max_top_k, select(md.top_p), md.top_p_index, select(md.min_p)
    )
    if cutoff is not None:
        x.masked_fill_(x < cutoff.unsqueeze(1), float("-inf"))
    probs = x.softmax(dim=-1)
    return probs.div_(_exponential_draws(probs, md)).argmax(dim=-1)


def _cutoff_logits(
    x: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
    top_p_index: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor | None:
    """Per row, the smallest logit that survives top-k, then top-p, then min-p (None: no filter)."""
    cutoff = None
    if top_k is not None:
        cutoff = _top_k_cutoff(x, top_k, max_top_k)
    if top_p is not None:
        cutoff = _apply_top_p_cutoff(x, top_p, top_p_index, cutoff)
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p). Renormalising after top-k/top-p
        # keeps the ratio p_i / p_max, so this needs no softmax; log(0) = -inf switches it off.
        min_p_cut = x.amax(dim=-1) + min_p.log()
        cutoff = min_p_cut if cutoff is None else torch.maximum(cutoff, min_p_cut)
    return cutoff


def _top_k_cutoff(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    # topk of the largest k in the batch, not a full sort: rows without top-k do not pay for it.
    k = min(max_top_k, x.shape[-1])
    values = x.topk(k, dim=-1).values
    kth = values.gather(1, (top_k.clamp(1, k) - 1).unsqueeze(1)).squeeze(1)
    return torch.where(top_k > 0, kth, float("-inf"))


def _apply_top_p_cutoff(
    x: torch.Tensor, top_p: torch.Tensor, top_p_index: torch.Tensor, cutoff: torch.Tensor | None
) -> torch.Tensor:
    """Raise the cut-off of the rows in top_p_index to their nucleus (taken after top-k)."""
    # Only rows that use top-p pay for the full sort.
    subset = top_p_index.numel() != x.shape[0]
    rows = x.index_select(0, top_p_index) if subset else x
    p = top_p.index_select(0, top_p_index) if subset else top_p
    ordered = rows.sort(dim=-1, descending=True).values
    if cutoff is None:
        cutoff = torch.full((x.shape[0],), float("-inf"), device=x.device)
    else:
        row_cut = cutoff.index_select(0, top_p_index) if subset else cutoff
        ordered.masked_fill_(ordered < row_cut.unsqueeze(1), float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum_(dim=-1)
    # Keep the smallest prefix whose mass reaches p: every token whose preceding mass is < p.
    # A cumsum of non-negative floats never decreases, so the count below marks a prefix.
    num_keep = ((cumulative < p.unsqueeze(1)).sum(dim=-1) + 1).clamp_(max=ordered.shape[-1])
    nucleus_cut = ordered.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
    # p == 1 keeps everything, even when rounding lets the cumulative sum reach 1 early. Where
    # p < 1 the nucleus is inside the top-k set, so its cut-off is already >= the top-k one.
    nucleus_cut = torch.where(p < 1.0, nucleus_cut, float("-inf"))
    if not subset:
        return torch.maximum(cutoff, nucleus_cut)
    return cutoff.index_copy(
        0, top_p_index, torch.maximum(cutoff.index_select(0, top_p_index), nucleus_cut)
    )


def _exponential_draws(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """q ~ Exp(1), one per token: seeded rows from their own generator, the rest from one draw.

    Drawn as -log(u), u ~ U[0, 1): on CPU this is ~3x faster than exponential_(), and u < 1
    keeps q > 0, so a masked token (prob 0) can never give 0/0 = NaN and win the argmax.
    """
    u = torch.empty_like(probs)
    if len(md.generators) < probs.shape[0]:
        u.uniform_()
    if md.generators:
        # Batch row -> row of `probs`, which holds only the random rows.
        position = None if md.all_random else {row: j for j, row in enumerate(md.random_rows)}
        for row, generator in md.generators.items():
            u[row if position is None else position[row]].uniform_(generator=generator)
    return u.log_().neg_()


def _gather_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids [sampled, top-1 .. top-num_top] and their log_softmax of the raw logits."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    ids = sampled.unsqueeze(1)
    if num_top > 0:
        ids = torch.cat([ids, logprobs.topk(num_top, dim=-1).indices], dim=1)
    return ids, logprobs.gather(1, ids)


# Device types where xgrammar's kernel failed once; they use the torch fallback from then on.
_XGRAMMAR_UNAVAILABLE: set[str] = set()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf, in place. Row i of `bitmask` (int32, xgrammar layout: bit j
    of word w allows token 32*w + j) masks row i of `logits`; rows of all ones (-1) allow all."""
    num_rows, vocab_size = logits.shape
    if bitmask.dim() != 2 or bitmask.shape[0] != num_rows:
        raise ValueError(f"bitmask must have shape [{num_rows}, words], got {list(bitmask.shape)}")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"bitmask covers {bitmask.shape[1] * 32} tokens but logits have "
            f"{vocab_size}; allocate it for the model's full vocabulary"
        )
    if logits.device.type == "cpu" and logits.dtype in _INT_VIEW:
        apply_token_bitmask_cpu(logits, bitmask.to("cpu", torch.int32))
        return
    bitmask = bitmask.to(device=logits.device, dtype=torch.int32, non_blocking=True)
    if logits.device.type not in _XGRAMMAR_UNAVAILABLE:
        try:
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
            return
        except Exception as exc:  # a missing kernel (no triton, odd dtype) is not fatal
            _XGRAMMAR_UNAVAILABLE.add(logits.device.type)
            logger.warning(
                "xgrammar bitmask kernel unavailable on %s (%s); using torch",
                logits.device.type,
                exc,
            )
    apply_token_bitmask_torch(logits, bitmask)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The vectorised torch fallback of apply_token_bitmask (same contract)."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    # Arithmetic shift of negative words copies the sign bit, but `& 1` still reads bit j.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.flatten(1)[:, :vocab_size].bool()
    logits.masked_fill_(~allowed, float("-inf"))


# Floating dtype -> the integer dtype of its size, for bitwise masking.
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# Rows are masked in chunks of about this many logits, so the temporaries stay in cache.
_CPU_CHUNK = 1 << 18
# Byte value -> its 8 bits (least significant first) as all-ones (allowed) or zero integers.
_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
_BYTE_KEEP = {torch.int32: -_BYTE_BITS.astype(np.int32), torch.int16: -_BYTE_BITS.astype(np.int16)}


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_token_bitmask for float32/bf16/f16 logits on the CPU (same contract).

    Branchless numpy on the logits' bits: one table lookup per mask byte
    widens its 8 bits to all-ones/zero integers ``keep``, then
    ``((bits ^ -inf) & keep) ^ -inf`` keeps the logit where the bit is 1 and
    writes -inf where it is 0, in three in-place passes. xgrammar's CPU kernel
    tests bit by bit and is several times slower on the mostly-forbidding
    masks of JSON structure; torch's integer ops cost ~2.5x these numpy
    passes at one thread. Rows that allow everything are skipped."""
    num_rows, vocab_size = logits.shape
    words = np.ascontiguousarray(bitmask.numpy()[:, : -(-vocab_size // 32)])
    rows = np.flatnonzero((words != -1).any(axis=1))
    if len(rows) == 0:
        return
    int_dtype = _INT_VIEW[logits.dtype]
    bits = logits.view(int_dtype).numpy()
    table = _BYTE_KEEP[int_dtype]
    neg_inf = bits.dtype.type(
        torch.tensor(float("-inf"), dtype=logits.dtype).view(int_dtype).item()
    )
    step = max(1, _CPU_CHUNK // vocab_size)
    contiguous = len(rows) == num_rows
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        rows_of = slice(start, start + len(chunk)) if contiguous else chunk
        keep = table.take(words[rows_of].view(np.uint8).astype(np.intp), axis=0)
        keep = keep.reshape(len(chunk), -1)[:, :vocab_size]
        # A slice is a view, written in place; fancy indexing copies, written back below.
        target = bits[rows_of]
        np.bitwise_xor(target, neg_inf, out=target)
        np.bitwise_and(target, keep, out=target)
        np.bitwise_xor(target, neg_inf, out=target)
        if not contiguous:
            bits[chunk] = target
