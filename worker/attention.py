"""Paged attention for stock transformers models.

We register one function with transformers' ``AttentionInterface``; a model
whose (text) config has ``_attn_implementation == PAGED_ATTENTION`` calls it in
every decoder layer. The forward is one packed sequence (batch 1) holding the
scheduled tokens of all requests. Per layer the function

1. writes the new K/V into that layer's cache at ``slot_mapping``
   (slot = block_id * block_size + offset), then
2. attends, for each request, over its whole context (cached + new tokens)
   read back from its blocks, causally.

The per-step metadata travels as the ``paged_attn`` forward kwarg: transformers
passes unknown ``**kwargs`` from the model forward down to attention functions.

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V), the layout flash-attn's ``block_table`` argument reads directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

PAGED_ATTENTION = "tokenbudget_paged"
# Upstream flash-attn reads a paged cache only with pages of a multiple of 256
# tokens; with smaller blocks we gather each request's KV into a packed tensor.
_FLASH_PAGE_MULTIPLE = 256
# sdpa decode batching: at most this many padded groups, of at least this many requests.
_MAX_DECODE_GROUPS = 4
_MIN_DECODE_GROUP = 16


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    # Zeros, not empty: padded reads of unused slots are masked out, but a NaN
    # there would still poison the softmax (0 * NaN).
    return [
        torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


@dataclass(slots=True)
class DecodeGroup:
    """Requests with one query token, attended in one padded SDPA call."""

    query_idx: torch.Tensor  # [Bd] token index in the packed sequence
    block_ids: torch.Tensor  # [Bd, max_blocks] block table, padded with the null block 0
    kv_mask: torch.Tensor  # [Bd, 1, 1, max_blocks * block_size] True where a key is real


@dataclass(slots=True)
class PrefillSeq:
    """A request with several query tokens (a prompt chunk or spec-decode verify)."""

    q_start: int
    q_end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)]
    mask: torch.Tensor | None  # [q, seq_len] causal mask, None when q == seq_len (is_causal)


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Everything one step's attention needs, built once and shared by all layers."""

    backend: str
    kv_caches: list[torch.Tensor]
    block_size: int
    slot_mapping: torch.Tensor  # [T] long
    query_start_loc: torch.Tensor  # [B+1] int32 (cu_seqlens_q)
    seq_start_loc: torch.Tensor  # [B+1] int32 (cu_seqlens_k)
    seq_lens: torch.Tensor  # [B] int32: context length (cached + new) of each request
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # sdpa: decodes in a few padded groups of similar length, longer queries one by one.
    decodes: tuple[DecodeGroup, ...] = ()
    prefills: tuple[PrefillSeq, ...] = ()
    # flash_attn with small blocks: every request's context slots, packed.
    packed_kv_slots: torch.Tensor | None = None
    # Each query sees its last ``window`` positions (itself included); 0: all.
    window: int = 0
    # Chunked local attention: a query at position p sees keys from p // chunk * chunk on.
    chunk: int = 0
    # With KV cache groups (worker/kv_groups.py): the metadata of each layer's group.
    by_layer: list[PagedAttentionMetadata] | None = None


def build_metadata(
    backend: str,
    kv_caches: list[torch.Tensor],
    block_size: int,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: np.ndarray,
    device: torch.device,
    window: int = 0,
    chunk: int = 0,
) -> PagedAttentionMetadata:
    """Host-side, vectorised: ``block_tables`` holds one row per scheduled request
    (``window``: the attention window of the layers reading it, 0: full;
    ``chunk``: their attention chunk size, 0: none)."""
    query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start[1:])
    seq_start = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(seq_lens, out=seq_start[1:])

    def to_dev(a, dt):
        return torch.from_numpy(np.ascontiguousarray(a)).to(
            device=device, dtype=dt, non_blocking=True
        )

    meta = PagedAttentionMetadata(
        backend=backend,
        kv_caches=kv_caches,
        block_size=block_size,
        slot_mapping=to_dev(slot_mapping, torch.long),
        query_start_loc=to_dev(query_start, torch.int32),
        seq_start_loc=to_dev(seq_start, torch.int32),
        seq_lens=to_dev(seq_lens, torch.int32),
        block_tables=to_dev(block_tables, torch.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        window=window,
        chunk=chunk,
    )
    if backend == "flash_attn":
        if block_size % _FLASH_PAGE_MULTIPLE:
            meta.packed_kv_slots = to_dev(
                _context_slots(block_tables, seq_lens, block_size), torch.long
            )
        return meta
    if backend in _PAGED_KERNEL_MODULES:  # in-place kernels need only the tensors above
        return meta
    meta.decodes, meta.prefills = _sdpa_plan(
        query_lens, query_start, seq_lens, block_tables, block_size, device, to_dev, window, chunk
    )
    return meta


def _sdpa_plan(
    query_lens: np.ndarray,
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device,
    to_dev,
    window: int = 0,
    chunk: int = 0,
) -> tuple[tuple[DecodeGroup, ...], tuple[PrefillSeq, ...]]:
    """sdpa's (decodes, prefills): PagedAttentionMetadata's fields of that name."""
    # Reads gather whole blocks (index_select over contiguous block rows), far
    # cheaper on CPU than gathering token by token.
    num_blocks = -(-seq_lens // block_size)
    is_decode = query_lens == 1
    decode_idx = np.flatnonzero(is_decode)
    # Sorted by length and cut into equal groups, padding waste falls from
    # ~1/2 to ~1/8 of the attention work for uniformly spread lengths.
    decode_idx = decode_idx[np.argsort(seq_lens[decode_idx], kind="stable")]
    num_groups = min(_MAX_DECODE_GROUPS, -(-len(decode_idx) // _MIN_DECODE_GROUP))
    decodes = (
        tuple(
            _decode_group(
                idx, query_start, seq_lens, block_tables, block_size, to_dev, window, chunk
            )
            for idx in np.array_split(decode_idx, num_groups)
            if len(idx)
        )
        if num_groups
        else ()
    )
    prefills = []
    for i in np.flatnonzero(~is_decode):
        q, L = int(query_lens[i]), int(seq_lens[i])
        mask = None
        if q != L or (window and window < L) or (chunk and chunk < L):
            # Query j sits at absolute position L - q + j and sees keys 0..L-q+j
            # (the last ``window`` of them with a window, those of its chunk with chunks).
            mask = torch.ones(q, L, dtype=torch.bool, device=device).tril(L - q)
            if window:
                mask &= ~torch.ones_like(mask).tril(L - q - window)
            if chunk:
                pos = torch.arange(L - q, L, device=device)[:, None]
                mask &= torch.arange(L, device=device)[None, :] >= pos // chunk * chunk
        prefills.append(
            PrefillSeq(
                int(query_start[i]),
                int(query_start[i + 1]),
                L,
                to_dev(block_tables[i, : num_blocks[i]], torch.long),
                mask,
            )
        )
    return decodes, tuple(prefills)


def _decode_group(
    idx: np.ndarray,
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    to_dev,
    window: int = 0,
    chunk: int = 0,
) -> DecodeGroup:
    max_blocks = -(-int(seq_lens[idx].max()) // block_size)
    pos = np.arange(max_blocks * block_size)[None, :]
    valid = pos < seq_lens[idx, None]
    if window:
        valid &= pos >= seq_lens[idx, None] - window
    if chunk:  # the query sits at seq_len - 1
        valid &= pos >= (seq_lens[idx, None] - 1) // chunk * chunk
    return DecodeGroup(
        to_dev(query_start[idx], torch.long),
        to_dev(block_tables[idx, :max_blocks], torch.long),
        to_dev(valid[:, None, None, :], torch.bool),
    )


def _context_slots(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slots of positions 0..seq_len-1 of each row, concatenated."""
    req = np.repeat(np.arange(len(seq_lens)), seq_lens)
    starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    pos = np.arange(int(seq_lens.sum())) - starts
    return block_tables[req, pos // block_size].astype(np.int64) * block_size + pos % block_size


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_attn: PagedAttentionMetadata | None = None,
    **kwargs,
):
    """The AttentionInterface entry point: query [1, H, T, D], key/value [1, Hkv, T, D]."""
    if paged_attn is None:
        raise RuntimeError(
            f"{PAGED_ATTENTION} attention needs the 'paged_attn' forward kwarg; "
            "run this model through tokenbudget's ModelRunner"
        )
    meta = paged_attn if paged_attn.by_layer is None else paged_attn.by_layer[module.layer_idx]
    window = kwargs.get("sliding_window") or 0
    # The window is the layer's KV group's (worker/kv_groups.py), masked by its
    # metadata; only the profile run (one plain metadata) reads without it.
    if window and meta.window and window != meta.window:
        raise NotImplementedError(
            f"layer {module.layer_idx} has a sliding window of {window} tokens that its "
            f"KV cache group does not know ({meta.window or 'full attention'})"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks are not supported by the paged backend")
    softcap = kwargs.get("softcap") or None
    q = query[0].transpose(0, 1)  # [T, H, D]
    if getattr(module, "attn_temperature_tuning", False) and not module.use_rope:
        q = _retune_temperature(q, module, meta)
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    cache = meta.kv_caches[module.layer_idx]
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape[1:]
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
    flat[1].index_copy_(0, meta.slot_mapping, v.to(cache.dtype))
    if meta.backend == "sdpa":
        out = _sdpa_attention(q, cache, meta, scaling, softcap)
    elif meta.backend == "flash_attn":
        out = _flash_attention(q, cache, flat, meta, scaling)
    elif meta.window or softcap or meta.chunk:
        kernel = paged_kernel(meta.backend)
        masking = dict(sliding_window=meta.window, softcap=softcap, chunk=meta.chunk)
        out = kernel(q, cache[0], cache[1], meta, scaling, **masking)
    else:
        out = paged_kernel(meta.backend)(q, cache[0], cache[1], meta, scaling)
    return out.unsqueeze(0), None


def _retune_temperature(q: torch.Tensor, module, meta: PagedAttentionMetadata) -> torch.Tensor:
    """Llama 4's NoPE layers scale the query at position p by
    ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``, p counted from
    transformers' KV cache, which the paged forward has none of: the query
    arrives scaled by its index in the packed step. Rescale to its position."""
    qs, seq_lens = meta.query_start_loc.long(), meta.seq_lens.long()
    q_lens = qs[1:] - qs[:-1]
    req = torch.repeat_interleave(torch.arange(len(q_lens), device=q.device), q_lens)
    index = torch.arange(q.shape[0], device=q.device)
    pos = index.clone()  # tokens past the last request (padding) keep their scale
    pos[: len(req)] = index[: len(req)] - qs[req] + seq_lens[req] - q_lens[req]

    def scale(p: torch.Tensor) -> torch.Tensor:
        steps = torch.floor((p.float() + 1.0) / module.floor_scale)
        return torch.log1p(steps) * module.attn_scale + 1.0

    return (q * (scale(pos) / scale(index))[:, None, None]).to(q.dtype)


# Backends that read the paged cache in place, each in its own module as
# ``paged_attention(q [T, H, D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
# meta: PagedAttentionMetadata, scale: float | None) -> out [T, H, D]``: they
# read meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len
# and meta.max_seq_len, causal with the query's end aligned to the context's end;
# keywords ``sliding_window``, ``softcap`` and ``chunk`` (0 or None: off) mask more.
_PAGED_KERNEL_MODULES: dict[str, str] = {
    "triton": "tokenbudget.worker.attention_triton",
    "cpu": "tokenbudget.worker.attention_cpu",
}


def paged_kernel(backend: str):
    """The ``paged_attention`` function of an in-place backend, imported on first use."""
    import importlib

    return importlib.import_module(_PAGED_KERNEL_MODULES[backend]).paged_attention


def _attend(q, k, v, mask, scale, softcap, is_causal=False) -> torch.Tensor:
    """SDPA over [B, H, q, D] x [B, Hkv, k, D]; with a soft-cap, the scores
    become ``c * tanh(s / c)`` before the mask and softmax (Gemma-2)."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=True
        )
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


def _sdpa_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The reference backend: gather each request's blocks, then torch SDPA."""
    k_cache, v_cache = cache[0], cache[1]  # [num_blocks, block_size, Hkv, D]
    num_kv_heads, head_dim = k_cache.shape[2:]
    out = torch.empty_like(q)
    for d in meta.decodes:
        num_seqs = d.block_ids.shape[0]
        blocks = d.block_ids.flatten()
        kd = k_cache.index_select(0, blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        vd = v_cache.index_select(0, blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        qd = q.index_select(0, d.query_idx).unsqueeze(2)  # [Bd, H, 1, D]
        res = _attend(qd, kd.transpose(1, 2), vd.transpose(1, 2), d.kv_mask, scale, softcap)
        out.index_copy_(0, d.query_idx, res.squeeze(2))
    for p in meta.prefills:
        kp = k_cache.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)[: p.seq_len]
        vp = v_cache.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)[: p.seq_len]
        qp = q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        res = _attend(
            qp,
            kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0),
            p.mask,
            scale,
            softcap,
            is_causal=p.mask is None,
        )
        out[p.q_start : p.q_end] = res[0].transpose(0, 1)
    return out


def _flash_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    flat: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float | None,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    common = dict(
        cu_seqlens_q=meta.query_start_loc,
        cu_seqlens_k=meta.seq_start_loc,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
    )
    # flash-attn's causal mask is aligned bottom-right (the last query sees the
    # last key), which is exactly a chunk continuing its cached context.
    if meta.packed_kv_slots is None:
        return flash_attn_varlen_func(
            q, cache[0], cache[1], block_table=meta.block_tables, **common
        )
    k = flat[0].index_select(0, meta.packed_kv_slots)
    v = flat[1].index_select(0, meta.packed_kv_slots)
    return flash_attn_varlen_func(q, k, v, **common)


def register_paged_attention() -> None:
    """Idempotent: make PAGED_ATTENTION a valid transformers attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
