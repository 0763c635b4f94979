"""Paged attention against a dense, naive causal attention over the same tokens."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenbudget.worker.attention import allocate_kv_caches, build_metadata, paged_attention_forward
from tokenbudget.worker.attention_select import flash_attn_available

H, HKV, D = 4, 2, 16


def naive_attention(q, k, v, scale):
    """q [q, H, D], k/v [L, Hkv, D]; query j sits at position L - q + j."""
    n_q, n_k = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]
    scores = scores.masked_fill(torch.arange(n_k)[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def random_batch(
    rng,
    block_size,
    num_blocks,
    device="cpu",
    dtype=torch.float32,
    num_reqs=None,
    query_choices=(1, 1, 2, 5, 17, 40),
):
    """Requests with random cached prefixes, query lengths and shuffled block tables."""
    num_reqs = num_reqs or int(rng.integers(1, 7))
    query_lens = rng.choice(query_choices, size=num_reqs)
    cached = rng.integers(0, 50, size=num_reqs)
    seq_lens = query_lens + cached
    max_blocks = int(-(-seq_lens.max() // block_size))
    free = rng.permutation(np.arange(1, num_blocks))  # block 0 is the null block
    tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    used = 0
    for i, n in enumerate(-(-seq_lens // block_size)):
        tables[i, :n] = free[used : used + n]
        used += n
    caches = allocate_kv_caches(1, num_blocks, block_size, HKV, D, dtype, torch.device(device))
    flat = caches[0].view(2, -1, HKV, D)
    contexts, slot_mapping = [], []
    for i in range(num_reqs):
        pos = np.arange(seq_lens[i])
        slots = tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
        k = torch.randn(seq_lens[i], HKV, D, dtype=dtype, device=device)
        v = torch.randn(seq_lens[i], HKV, D, dtype=dtype, device=device)
        n_cached = cached[i]
        flat[0][torch.from_numpy(slots[:n_cached]).to(device)] = k[:n_cached]
        flat[1][torch.from_numpy(slots[:n_cached]).to(device)] = v[:n_cached]
        contexts.append((k, v))
        slot_mapping.append(slots[n_cached:])
    q = torch.randn(int(query_lens.sum()), H, D, dtype=dtype, device=device)
    new_k = torch.cat([k[c:] for (k, _), c in zip(contexts, cached)])
    new_v = torch.cat([v[c:] for (_, v), c in zip(contexts, cached)])
    return SimpleNamespace(
        q=q,
        new_k=new_k,
        new_v=new_v,
        contexts=contexts,
        caches=caches,
        query_lens=query_lens,
        seq_lens=seq_lens,
        tables=tables,
        slot_mapping=np.concatenate(slot_mapping),
    )


def run_paged(backend, b, block_size, device="cpu"):
    meta = build_metadata(
        backend,
        b.caches,
        block_size,
        b.query_lens,
        b.seq_lens,
        b.tables,
        b.slot_mapping,
        torch.device(device),
    )
    module = SimpleNamespace(layer_idx=0)
    out, _ = paged_attention_forward(
        module,
        b.q.transpose(0, 1)[None],
        b.new_k.transpose(0, 1)[None],
        b.new_v.transpose(0, 1)[None],
        None,
        scaling=D**-0.5,
        paged_attn=meta,
    )
    return out[0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [4, 16])
def test_sdpa_paged_attention_equals_dense_causal_attention(seed, block_size):
    rng = np.random.default_rng(seed)
    b = random_batch(rng, block_size, num_blocks=256)
    out = run_paged("sdpa", b, block_size)
    start = 0
    for i, (k, v) in enumerate(b.contexts):
        end = start + int(b.query_lens[i])
        torch.testing.assert_close(
            out[start:end], naive_attention(b.q[start:end], k, v, D**-0.5), atol=1e-5, rtol=1e-5
        )
        start = end


def test_many_decodes_split_into_length_groups_still_equal_dense_attention():
    rng = np.random.default_rng(11)
    b = random_batch(rng, 4, num_blocks=1024, num_reqs=70, query_choices=(1, 1, 1, 1, 3))
    out = run_paged("sdpa", b, 4)
    start = 0
    for i, (k, v) in enumerate(b.contexts):
        end = start + int(b.query_lens[i])
        torch.testing.assert_close(
            out[start:end], naive_attention(b.q[start:end], k, v, D**-0.5), atol=1e-5, rtol=1e-5
        )
        start = end


def test_paged_attention_writes_new_kv_at_slot_mapping():
    b = random_batch(np.random.default_rng(7), 8, num_blocks=64)
    run_paged("sdpa", b, 8)
    flat = b.caches[0].view(2, -1, HKV, D)
    slots = torch.from_numpy(b.slot_mapping)
    torch.testing.assert_close(flat[0][slots], b.new_k)
    torch.testing.assert_close(flat[1][slots], b.new_v)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not flash_attn_available(),
    reason="flash_attn backend needs CUDA and the flash-attn package, which cannot "
    "be installed on a CPU-only machine",
)
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_attn_backend_agrees_with_sdpa(block_size):
    for seed in range(4):
        rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        b = random_batch(rng, block_size, num_blocks=64, device="cuda", dtype=torch.bfloat16)
        sdpa = run_paged("sdpa", b, block_size, "cuda")
        flash = run_paged("flash_attn", b, block_size, "cuda")
        torch.testing.assert_close(flash.float(), sdpa.float(), atol=2e-2, rtol=2e-2)
