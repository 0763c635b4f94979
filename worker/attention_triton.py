"""The ``triton`` paged-attention backend: one kernel for decode, prefill and
mixed steps that reads K/V in place from the paged cache through the block
table, at any power-of-two block size (no per-layer gather).

One program handles ``BLOCK_Q`` consecutive query tokens of one request and
all the query heads of one KV head (GQA): its ``BLOCK_M = BLOCK_Q * G`` rows
share every K/V tile it loads, so a KV head's cache is read once per query
block, not once per query head. Decode and prefill chunks go through the same
code; a step's grid is sized from tensor shapes and host-side maxima only, so
launching never synchronises with the device. Scores and the online softmax
are fp32 whatever the input dtype.

Causality is bottom-right aligned: query ``j`` of a request with ``q`` new
tokens and context length ``L`` sits at position ``L - q + j`` and sees keys
``0 .. L - q + j`` (a chunk continuing its cached prefix). Optional, off by
default: a sliding window (a query sees its last ``W`` positions, itself
included, as transformers' sliding-window masks do), chunked local attention
(a query at position p sees the keys from ``p // C * C`` on, Llama 4) and a
logit soft-cap (``s -> c * tanh(s / c)``).

Decode steps with too few programs to fill the GPU (small batches, long
contexts) split each context into ``NUM_SPLITS`` ranges attended by separate
programs, whose partial results a second kernel merges (split-KV).

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) the
kernels run in triton's CPU interpreter: that is how the tests run them.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tokenbudget.worker.attention import PagedAttentionMetadata

# Rows (query tokens x heads of a group) per program: at least 16, as tl.dot
# needs every dimension >= 16 on GPUs; up to 64 when queries are long, so each
# K/V tile read serves more queries.
_MIN_BLOCK_M = 16
_MAX_BLOCK_M = 64
# Keys per loop iteration: short tiles for decode (keeps registers for more
# programs in flight), longer ones when a program holds many query rows.
_DECODE_TILE = 32
_PREFILL_TILE = 64
# Split-KV: at most this many splits, each of at least this many keys.
_MAX_KV_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 256
# The interpreter (triton 3.6 to 3.9 at least) multiplies bf16 operands of
# tl.dot as their raw uint16 bits, so there the kernel upcasts them to fp32
# first (UPCAST_DOT), after the same rounding to bf16 a GPU dot sees.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _find_request(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning query block ``q_block``: request i owns blocks from
    query_start_loc[i] // BLOCK_Q + i on (a bound on its block count that
    needs no host-side table); binary search for the last start <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(
    k_base, v_base, table, offs_n, n_ok, offs_d, d_ok, stride_kb, stride_ks, BLOCK_SIZE
):
    """K^T [D, TILE_N] and V [TILE_N, D] of keys ``offs_n``, read through the block table."""
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    off = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks
    # Zeros, not garbage, in masked lanes: padded head dims enter the dot products.
    kt = tl.load(k_base + off[None, :] + offs_d[:, None], n_ok[None, :] & d_ok[:, None], 0.0)
    v = tl.load(v_base + off[:, None] + offs_d[None, :], n_ok[:, None] & d_ok[None, :], 0.0)
    return kt, v


@triton.jit
def _first_key(pos, window, chunk, USE_WINDOW, USE_CHUNK):
    """The earliest key a query at position ``pos`` sees."""
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    if USE_CHUNK:
        lo = tl.maximum(lo, pos // chunk * chunk)
    return lo


@triton.jit
def _masked_scores(
    q, kt, offs_n, q_pos, row_ok, scale, softcap, window, chunk,
    USE_SOFTCAP, USE_WINDOW, USE_CHUNK, UPCAST, PREC,
):  # fmt: skip
    """Scaled (and soft-capped) scores, -inf where a row may not see a key."""
    if UPCAST:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PREC) * scale
    if USE_SOFTCAP:
        # tanh from exp keeps to what every triton version (and its interpreter) has.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    seen = (offs_n[None, :] <= q_pos[:, None]) & row_ok[:, None]
    if USE_WINDOW:
        seen = seen & (q_pos[:, None] - offs_n[None, :] < window)
    if USE_CHUNK:
        seen = seen & (offs_n[None, :] >= (q_pos // chunk * chunk)[:, None])
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _softmax_update(s, v, m_i, l_i, acc, UPCAST, PREC):
    """One online-softmax step: fold a tile's scores ``s`` and values ``v`` in."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing seen yet keeps m = -inf; subtract 0 so exp gives 0, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    # P is rounded to the cache dtype, as a tensor-core dot takes it.
    p_in = p.to(v.dtype)
    if UPCAST:
        v = v.to(tl.float32)
        p_in = p_in.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _store_rows(out_ptr, part_ptr, stats_ptr, acc, m_i, l_i, rows, row_ok, offs_d, d_ok,
                HEAD_DIM, HEAD_DIM_P, NUM_SPLITS):  # fmt: skip
    """The normalised output rows, or (split-KV) this split's unnormalised
    accumulator with its running max and sum for _combine_splits."""
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        ptrs = out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = rows * NUM_SPLITS + tl.program_id(2)
        tl.store(part_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc, row_ok[:, None])
        tl.store(stats_ptr + part * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_ptr, stats_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, softcap, window, chunk, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    q_block, kv_head = tl.program_id(0), tl.program_id(1)
    seq = _find_request(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return  # a spare program of the grid's upper bound
    ctx_len = tl.load(seq_lens_ptr + seq)
    offs_m, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM_P)
    q_idx = first_q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    # BLOCK_M is a power of two; with a group that is not, the last rows are spare.
    row_ok = (offs_m // QUERIES_PER_KV < BLOCK_Q) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = ctx_len - q_len + q_idx  # absolute position of each row's query
    q_off = (q_start + q_idx) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], row_ok[:, None] & d_ok[None, :], 0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Keys past the block's last query are masked for every row: stop there.
    kv_end = ctx_len - q_len + tl.minimum(first_q + BLOCK_Q, q_len)
    # The block's first query sees the earliest key any of its rows does.
    kv_begin = _first_key(ctx_len - q_len + first_q, window, chunk, USE_WINDOW, USE_CHUNK)
    kv_begin = kv_begin // TILE_N * TILE_N
    kv_stop = kv_end
    if NUM_SPLITS > 1:  # this program's share: whole tiles
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, TILE_N), NUM_SPLITS) * TILE_N
        kv_begin = kv_begin + tl.program_id(2) * per_split
        kv_stop = tl.minimum(kv_end, kv_begin + per_split)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    k_base, v_base = k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_kh
    for start in range(kv_begin, kv_stop, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = offs_n < kv_end
        kt, v = _load_kv_tile(
            k_base, v_base, table, offs_n, n_ok, offs_d, d_ok, stride_kb, stride_ks, BLOCK_SIZE
        )
        s = _masked_scores(
            q, kt, offs_n, q_pos, row_ok, scale, softcap, window, chunk, USE_SOFTCAP,
            USE_WINDOW, USE_CHUNK, UPCAST, PREC,
        )  # fmt: skip
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, UPCAST, PREC)
    rows = (q_start + q_idx) * (tl.num_programs(1) * QUERIES_PER_KV) + head
    _store_rows(out_ptr, part_ptr, stats_ptr, acc, m_i, l_i, rows, row_ok, offs_d, d_ok,
                HEAD_DIM, HEAD_DIM_P, NUM_SPLITS)  # fmt: skip


@triton.jit
def _combine_splits(
    out_ptr,
    part_ptr,
    stats_ptr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    """Merge one (token, head) row's split-KV partials: rescale each split's
    accumulator and sum from its running max to the global max."""
    row = tl.program_id(0)
    offs_s, offs_d = tl.arange(0, SPLITS_P), tl.arange(0, HEAD_DIM_P)
    s_ok = offs_s < NUM_SPLITS
    part = row * NUM_SPLITS + offs_s
    m = tl.load(stats_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(stats_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    acc = tl.load(part_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], s_ok[:, None], 0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), offs_d < HEAD_DIM)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_kv_splits(q: torch.Tensor, meta: PagedAttentionMetadata, num_programs: int) -> int:
    """Split-KV only for decode steps whose programs leave SMs idle, and only
    as far as each split keeps _MIN_KEYS_PER_SPLIT keys of the longest context
    (meta.max_seq_len, a host int: a captured CUDA graph keeps the count its
    capture step chose, which changes speed, never results)."""
    if q.device.type != "cuda" or meta.max_query_len != 1:
        return 1
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1
    splits = min(_MAX_KV_SPLITS, -(-2 * sms // num_programs))
    return max(1, min(splits, meta.max_seq_len // _MIN_KEYS_PER_SPLIT))


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"the triton backend needs a power-of-two block size, got {block_size}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "the triton backend needs unit-stride head dims and K, V caches of one layout"
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float | None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_kv_splits: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of the packed queries ``q [T, H, D]`` over each request's
    context in ``k_cache`` / ``v_cache [num_blocks, block_size, Hkv, D]``
    (already holding this step's K/V), for the requests of ``meta``
    (query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len).
    Returns ``[T, H, D]``, contiguous.

    ``sliding_window``: each query sees its last W positions (itself
    included); ``chunk``: a query at position p sees keys from ``p // chunk *
    chunk`` on; ``softcap``: scores become ``c * tanh(s / c)`` before softmax;
    ``num_kv_splits``: split-KV ranges per context (default: chosen per step)."""
    _check_inputs(q, k_cache, v_cache)
    (num_tokens, num_heads, head_dim), num_kv_heads = q.shape, k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = group * max(1, min(meta.max_query_len, _MAX_BLOCK_M // group))
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(rows))
    num_seqs = meta.seq_lens.shape[0]
    # Request i has at most q_i // block_q + 1 query blocks: the sum bounds the grid.
    num_q_blocks = num_tokens // (block_m // group) + num_seqs
    splits = num_kv_splits or _num_kv_splits(q, meta, num_q_blocks * num_kv_heads)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    part = stats = out  # unused without split-KV
    if splits > 1:
        part = torch.empty(num_tokens, num_heads, splits, head_dim_p, device=q.device)
        stats = torch.empty(num_tokens, num_heads, splits, 2, device=q.device)
    tables = meta.block_tables
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, splits)](
        out, part, stats, q, k_cache, v_cache, tables, meta.seq_lens, meta.query_start_loc,
        scale if scale is not None else 1.0 / math.sqrt(head_dim),
        float(softcap or 0.0), int(sliding_window or 0), int(chunk or 0), num_seqs,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=k_cache.shape[1],
        QUERIES_PER_KV=group, BLOCK_Q=block_m // group, BLOCK_M=block_m,
        TILE_N=_DECODE_TILE if meta.max_query_len == 1 else _PREFILL_TILE, NUM_SPLITS=splits,
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(sliding_window), USE_CHUNK=bool(chunk),
        UPCAST=_INTERPRETED and q.dtype == torch.bfloat16,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if splits > 1:
        _combine_splits[(num_tokens * num_heads,)](
            out, part, stats, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=splits,
            SPLITS_P=triton.next_power_of_2(splits),
        )  # fmt: skip
    return out
