"""The ``cpu`` attention backend (our C++ kernel, worker/csrc/paged_attention_cpu.cpp)
against a dense, naive causal attention over the same tokens, on seeded random
paged batches: ragged lengths, chunks continuing a cached context, blocks
shared by two requests (prefix hits), GQA, float32 and bfloat16, block sizes
1, 8 and 16. A block table off by one block must fail the same comparison.
Then the whole engine: greedy tokens equal transformers generate().

The kernel is built once per machine (torch's extension folder); the first
test to need it pays the build (about 7 CPU-seconds of g++).
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM
from tokenbudget.worker import attention_cpu
from tokenbudget.worker import attention_select
from tokenbudget.worker.attention import allocate_kv_caches, build_metadata, paged_attention_forward

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def kernel_builds():
    # g++ is on every machine we test on: a kernel that does not build is a failure here.
    assert attention_cpu.cpu_kernel_problem() is None


def naive_attention(q, k, v, scale, window=None, softcap=None, chunk=None):
    """q [q, H, D], k/v [L, Hkv, D], in float64; query j sits at position L - q + j
    and sees the keys up to it (its last ``window`` ones; with ``chunk``, only
    those in its chunk of that many positions); scores soft-capped."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    n_q, n_k = q.shape[0], k.shape[0]
    key, pos = torch.arange(n_k)[None, :], torch.arange(n_k - n_q, n_k)[:, None]
    hidden = (key > pos) | (key <= pos - window) if window else key > pos
    if chunk:
        hidden |= key // chunk != pos // chunk
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, -math.inf).softmax(-1), v)


def paged_batch(rng, *, block_size, num_kv_heads, group, head_dim, dtype):
    """1-8 requests: decodes, whole prompts and chunks over a cached context,
    of ragged lengths; a request may share its first cached blocks with an
    earlier one (a prefix hit: same block ids, same K/V). Block ids shuffled."""
    num_reqs = int(rng.integers(1, 9))
    seq_lens = rng.integers(1, 200, size=num_reqs)
    kind = rng.choice(["decode", "prompt", "chunk"], size=num_reqs)
    query_lens = np.where(
        kind == "decode",
        1,
        np.where(kind == "prompt", seq_lens, [int(rng.integers(1, n + 1)) for n in seq_lens]),
    )
    num_blocks = int((-(-seq_lens // block_size)).sum()) + 2
    free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0: the null block
    tables = np.zeros((num_reqs, int(-(-seq_lens.max() // block_size))), dtype=np.int32)
    ks, vs, shared = [], [], []
    for i in range(num_reqs):
        L, cached = int(seq_lens[i]), int(seq_lens[i] - query_lens[i])
        k = torch.randn(L, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(L, num_kv_heads, head_dim).to(dtype)
        n_shared = 0
        if i and rng.random() < 0.5:  # share full cached blocks with an earlier request
            j = int(rng.integers(0, i))
            n_shared = min(cached, int(seq_lens[j] - query_lens[j])) // block_size
            tables[i, :n_shared] = tables[j, :n_shared]
            k[: n_shared * block_size] = ks[j][: n_shared * block_size]
            v[: n_shared * block_size] = vs[j][: n_shared * block_size]
        n_blocks = -(-L // block_size)
        tables[i, n_shared:n_blocks] = [free.pop() for _ in range(n_blocks - n_shared)]
        ks.append(k)
        vs.append(v)
        shared.append(n_shared)
    (cache,) = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, CPU)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    new_slots = []
    for i in range(num_reqs):
        pos = np.arange(seq_lens[i])
        slots = torch.from_numpy(tables[i, pos // block_size] * block_size + pos % block_size)
        cached = int(seq_lens[i] - query_lens[i])
        flat[0][slots[:cached].long()] = ks[i][:cached]
        flat[1][slots[:cached].long()] = vs[i][:cached]
        new_slots.append(slots[cached:].numpy())
    return SimpleNamespace(
        q=torch.randn(int(query_lens.sum()), num_kv_heads * group, head_dim).to(dtype),
        new_k=torch.cat([k[s - q :] for k, s, q in zip(ks, seq_lens, query_lens)]),
        new_v=torch.cat([v[s - q :] for v, s, q in zip(vs, seq_lens, query_lens)]),
        ks=ks,
        vs=vs,
        cache=cache,
        block_size=block_size,
        query_lens=query_lens,
        seq_lens=seq_lens,
        tables=tables,
        slot_mapping=np.concatenate(new_slots).astype(np.int64),
        num_shared_blocks=shared,
    )


def batch(seed, *, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32):
    return paged_batch(
        np.random.default_rng(seed),
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )


def run_paged(backend, b, tables=None, window=None, softcap=None, chunk=None):
    """One layer's paged_attention_forward: writes the new K/V, then attends."""
    meta = build_metadata(
        backend,
        [b.cache],
        b.block_size,
        b.query_lens,
        b.seq_lens,
        b.tables if tables is None else tables,
        b.slot_mapping,
        CPU,
        window=window or 0,
        chunk=chunk or 0,
    )
    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0),
        b.q.transpose(0, 1)[None],
        b.new_k.transpose(0, 1)[None],
        b.new_v.transpose(0, 1)[None],
        None,
        scaling=b.q.shape[-1] ** -0.5,
        paged_attn=meta,
        sliding_window=window,
        softcap=softcap,
    )
    return out[0]


def assert_equals_dense(b, out, **masking):
    tol = 1e-5 if b.q.dtype == torch.float32 else 2e-2
    starts = np.concatenate([[0], np.cumsum(b.query_lens)])
    for i, (k, v) in enumerate(zip(b.ks, b.vs)):
        lo, hi = int(starts[i]), int(starts[i + 1])
        want = naive_attention(b.q[lo:hi], k, v, b.q.shape[-1] ** -0.5, **masking)
        torch.testing.assert_close(out[lo:hi].double(), want, atol=tol, rtol=tol)


# 6 x 18 = 108 random batches.
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_kernel_equals_dense_attention_on_random_paged_batches(seed, block_size, group, dtype):
    torch.manual_seed(seed)
    b = batch([seed, block_size, group], block_size=block_size, group=group, dtype=dtype)
    out = run_paged("cpu", b)
    assert out.dtype == dtype and out.shape == b.q.shape
    assert_equals_dense(b, out)


@pytest.mark.parametrize(
    "window,softcap", [(1, None), (5, None), (37, None), (None, 20.0), (16, 8.0)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sliding_window_and_softcap_equal_dense_attention(window, softcap, dtype):
    for seed in range(4):
        b = batch([seed, 9], block_size=8, group=2, dtype=dtype)
        out = run_paged("cpu", b, window=window, softcap=softcap)
        assert_equals_dense(b, out, window=window, softcap=softcap)
        torch.testing.assert_close(
            out, run_paged("sdpa", b, window=window, softcap=softcap), atol=2e-2, rtol=2e-2
        )


def null_before_first_visible_block(b, window=None, chunk=None):
    """``b.tables`` with every block no query of its request sees replaced by
    the null block 0 (as a sliding / chunked KV group frees them), and the
    null block filled with garbage that any unmasked read would pick up."""
    tables = b.tables.copy()
    for i, (L, q) in enumerate(zip(b.seq_lens, b.query_lens)):
        first = int(L - q)  # the first query's position: it sees the earliest keys
        lo = max(0, first - window + 1) if window else 0
        lo = max(lo, first // chunk * chunk) if chunk else lo
        tables[i, : lo // b.block_size] = 0
    b.cache[:, 0] = 100.0
    return tables


# Chunks of one token, shorter and longer than a block, not a block multiple,
# with a sliding window too; blocks of 1, 8 and 16; GQA groups that take the
# decode, row-wise prefill and transposed prefill tiles of the kernel.
@pytest.mark.parametrize(
    "chunk,window,block_size",
    [(1, None, 8), (5, None, 8), (8, None, 8), (13, None, 1), (24, None, 16), (32, 20, 8)],
)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_local_attention_equals_dense_attention(chunk, window, block_size, group, dtype):
    for seed in range(4):
        b = batch([seed, 13, chunk], block_size=block_size, group=group, dtype=dtype)
        tables = null_before_first_visible_block(b, window, chunk)
        masking = dict(window=window, chunk=chunk)
        out = run_paged("cpu", b, tables, **masking)
        assert_equals_dense(b, out, **masking)
        assert_equals_dense(b, run_paged("sdpa", b, tables, **masking), **masking)


def test_a_chunk_off_by_one_fails_the_comparison():
    b = batch(5, block_size=8)
    assert_equals_dense(b, run_paged("cpu", b, chunk=16), chunk=16)
    with pytest.raises(AssertionError):
        assert_equals_dense(b, run_paged("cpu", b, chunk=17), chunk=16)
    with pytest.raises(AssertionError):
        assert_equals_dense(b, run_paged("sdpa", b, chunk=15), chunk=16)


@pytest.mark.parametrize("head_dim", [16, 24, 128])  # 24: padded to whole vectors inside
def test_cpu_kernel_handles_other_head_sizes_and_many_decodes(head_dim):
    for seed in range(3):
        b = batch(100 + seed, num_kv_heads=4, head_dim=head_dim)
        assert_equals_dense(b, run_paged("cpu", b))


def test_the_batches_exercise_every_case():
    """The generator makes what the equality test claims to cover."""
    seen = dict(decode=0, chunk=0, prompt=0, shared=0)
    for seed in range(6):
        b = batch([seed, 16, 2])
        seen["decode"] += int((b.query_lens == 1).sum())
        seen["chunk"] += int(((b.query_lens > 1) & (b.query_lens < b.seq_lens)).sum())
        seen["prompt"] += int(((b.query_lens > 1) & (b.query_lens == b.seq_lens)).sum())
        seen["shared"] += sum(n > 0 for n in b.num_shared_blocks)
    assert min(seen.values()) > 0, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_block_table_off_by_one_block_fails_the_comparison(dtype):
    b = batch(7, block_size=8, dtype=dtype)
    assert b.seq_lens.max() > 8  # some request reads a second block
    assert_equals_dense(b, run_paged("cpu", b))
    # Every request reads its blocks one table entry late (its last: the null block).
    shifted = np.zeros_like(b.tables)
    shifted[:, :-1] = b.tables[:, 1:]
    with pytest.raises(AssertionError):
        assert_equals_dense(b, run_paged("cpu", b, tables=shifted))


def test_cpu_kernel_equals_the_sdpa_backend():
    """The two backends side by side on the same cache (the reference path)."""
    for seed in range(4):
        b = batch(seed)
        torch.testing.assert_close(run_paged("cpu", b), run_paged("sdpa", b), atol=1e-5, rtol=1e-5)


# -- choosing the backend ----------------------------------------------------------------
def test_auto_on_cpu_picks_the_kernel_when_it_works():
    assert attention_select.resolve_backend("auto", CPU, torch.float32) == "cpu"
    assert attention_select.resolve_backend("auto", CPU, torch.bfloat16) == "cpu"
    assert attention_select.resolve_backend("sdpa", CPU, torch.float32) == "sdpa"


def test_auto_falls_back_to_sdpa_saying_why_and_cpu_refuses(monkeypatch, caplog):
    monkeypatch.setattr(
        attention_cpu, "cpu_kernel_problem", lambda: "the C++ kernel did not build (no g++)"
    )
    with caplog.at_level(logging.WARNING, logger="tokenbudget.worker.attention_select"):
        assert attention_select.resolve_backend("auto", CPU, torch.float32) == "sdpa"
    (record,) = [r for r in caplog.records if "cpu kernel" in r.getMessage()]
    assert "no g++" in record.getMessage()
    with pytest.raises(ValueError, match="attention_backend='cpu': the C.. kernel did not build"):
        attention_select.resolve_backend("cpu", CPU, torch.float32)


def test_cpu_backend_refuses_other_devices_and_dtypes():
    with pytest.raises(ValueError, match="runs on CPU"):
        attention_select.resolve_backend("cpu", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        attention_select.resolve_backend("cpu", CPU, torch.float64)
    assert attention_select.resolve_backend("auto", CPU, torch.float64) == "sdpa"


def test_without_a_compiler_the_build_problem_names_it(monkeypatch, tmp_path):
    # A fresh extension folder (nothing built to reuse) and a compiler that is not there.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    problem = attention_cpu._build.__wrapped__()
    assert problem is not None and problem.startswith("the C++ kernel did not build")
    assert "no-such-g++: not found" in problem


# -- the engine --------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "backend,engine_args",
    [
        ("cpu", {"max_num_batched_tokens": 64}),
        ("cpu", {"max_num_batched_tokens": 48, "block_size": 8}),
        # auto picks cpu on CPU now: the reference path keeps an end-to-end check.
        ("sdpa", {"max_num_batched_tokens": 64}),
    ],
    ids=["chunked-prefill", "small-chunks-blocks-of-8", "sdpa-reference"],
)
def test_greedy_tokens_with_the_cpu_kernel_equal_transformers_generate(
    tiny_qwen3_path, prompts, hf_greedy, backend, engine_args
):
    """Chunked prefill over cached context, and prefix hits: the same prompts
    again, and prompts that share their first 40 tokens with another."""
    shared = [prompts[5][:40] + p for p in (prompts[1], prompts[3])]
    batch = [*prompts, *shared]
    expected = [hf_greedy(p, 16) for p in batch]
    llm = LLM(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        attention_backend=backend,
        num_gpu_blocks=256,
        async_scheduling=False,
        **engine_args,
    )
    assert llm.engine.executor.worker.model_runner.attention_backend == backend
    first = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    again = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    assert [r.token_ids for r in first] == expected
    assert [r.token_ids for r in again] == expected
    assert all(r.num_cached_tokens > 0 for r in again if len(r.prompt_token_ids) > 16)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "window, softcap, chunk", [(None, None, None), (20, 3.0, None), (None, None, 13)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attend_step_writes_the_cache_and_attends_like_the_python_path(
    seed, window, softcap, chunk, dtype
):
    """attention_cpu.attend_step (one C++ call per layer of a compiled step)
    leaves the same cache and returns the same output as the Python path,
    and both equal dense attention."""
    b = batch(seed, block_size=8, dtype=dtype)
    before = b.cache.clone()
    want = run_paged("cpu", b, window=window, softcap=softcap, chunk=chunk)
    written, b.cache = b.cache, before
    meta = build_metadata(
        "cpu", [b.cache], 8, b.query_lens, b.seq_lens, b.tables, b.slot_mapping, CPU,
        window=window or 0, chunk=chunk or 0,
    )  # fmt: skip
    scale = b.q.shape[-1] ** -0.5
    qkv = [t.transpose(0, 1)[None] for t in (b.q, b.new_k, b.new_v)]
    got = attention_cpu.attend_step(*qkv, meta, 0, scale, softcap or 0.0)
    assert got.shape == (1, *b.q.shape) and got.is_contiguous() and got.dtype == dtype
    assert torch.equal(b.cache, written)
    torch.testing.assert_close(got[0], want, atol=0, rtol=0)
    assert_equals_dense(b, got[0], window=window, softcap=softcap, chunk=chunk)
