"""The triton paged-attention kernel, run on CPU in triton's interpreter,
against a naive oracle: each request's dense K/V, causal softmax in fp32.

Not collected by the suite: test_triton_attention.py runs this file in a
pytest subprocess with ``TRITON_INTERPRET=1``, which must be set before triton
is first imported (its standard library, tl.max and friends, is wrapped for
the interpreter or for the compiler at import), so it cannot leak into the
other tests' process.

The 200 seeded random paged batches (``paged_case(seed)``, seeds 0..199):

- block size 8, 16 or 32; GQA groups of 1, 4, 8 or 3 query heads per KV head
  (KV heads 2, 2, 1, 1; 3 leaves spare rows in a program); head dim 16
  (seeds = 0 mod 7: head dim 24, padded to 32);
- dtype float32 or bfloat16 (every other seed);
- 1 to 3 requests; each has a cached prefix of 0..70 tokens and a query of
  1 (decode), 2, 7, 16 or 23 tokens, so chunks start and end inside blocks
  and on their boundaries, and contexts span up to 3 key tiles;
- every other batch with requests 0 and 1 sharing their leading full blocks
  (the same block ids, as after a prefix-cache hit);
- block tables drawn from a shuffled pool; unused slots hold random K/V, so a
  read outside a request's blocks shows.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_triton_attention.py with TRITON_INTERPRET=1", allow_module_level=True)

from tokenbudget.worker.attention import build_metadata  # noqa: E402
from tokenbudget.worker import attention_triton  # noqa: E402

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
NUM_CASES = 200


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per request, its dense context [L, Hkv, D]
    values: list[torch.Tensor]
    query_lens: np.ndarray
    seq_lens: np.ndarray
    tables: np.ndarray

    def metadata(self, tables: np.ndarray | None = None):
        tables = self.tables if tables is None else tables
        num_tokens = int(self.query_lens.sum())
        slots = np.zeros(num_tokens, dtype=np.int64)  # unused: K/V are already in place
        bs = self.k_cache.shape[1]
        return build_metadata("triton", [], bs, self.query_lens, self.seq_lens, tables, slots, CPU)


def paged_case(seed: int) -> PagedCase:
    """One random paged batch (see the module docstring for the ranges)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    block_size = int(rng.choice([8, 16, 32]))
    group, num_kv_heads = [(1, 2), (4, 2), (8, 1), (3, 1)][int(rng.integers(4))]
    head_dim = 24 if seed % 7 == 0 else 16
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    num_reqs = int(rng.integers(1, 4))
    query_lens = rng.choice([1, 1, 2, 7, 16, 23], size=num_reqs)
    seq_lens = query_lens + rng.integers(0, 71, size=num_reqs)
    num_shared = 0
    if num_reqs > 1 and seed % 4 < 2:
        full = min(seq_lens[0], seq_lens[1] - 1) // block_size  # request 1 keeps a query
        num_shared = int(rng.integers(1, full + 1)) if full else 0

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    num_blocks = int((-(-seq_lens // block_size)).sum()) + 8
    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    pool = iter(rng.permutation(np.arange(1, num_blocks)).tolist())
    tables = np.zeros((num_reqs, int(-(-seq_lens.max() // block_size))), dtype=np.int32)
    keys, values = [], []
    for i, length in enumerate(seq_lens):
        k, v = rand(length, num_kv_heads, head_dim), rand(length, num_kv_heads, head_dim)
        for b in range(-(-length // block_size)):
            shared = i == 1 and b < num_shared
            tables[i, b] = tables[0, b] if shared else next(pool)
            span = slice(b * block_size, min((b + 1) * block_size, length))
            if shared:  # a prefix hit: request 1's leading tokens are request 0's
                k[span], v[span] = keys[0][span], values[0][span]
            n = span.stop - span.start
            k_cache[tables[i, b], :n], v_cache[tables[i, b], :n] = k[span], v[span]
        keys.append(k)
        values.append(v)
    q = rand(int(query_lens.sum()), num_kv_heads * group, head_dim)
    return PagedCase(q, k_cache, v_cache, keys, values, query_lens, seq_lens, tables)


def reference(case: PagedCase, window: int | None = None, softcap: float | None = None, chunk=None):
    """Dense causal attention per request in fp32: query j of q sits at position L - q + j."""
    out, start = [], 0
    group = case.q.shape[1] // case.keys[0].shape[1]
    scale = 1.0 / math.sqrt(case.q.shape[2])
    for k, v, n_q in zip(case.keys, case.values, case.query_lens):
        q = case.q[start : start + n_q].float()
        start += n_q
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(len(k) - n_q, len(k))[:, None]
        k_pos = torch.arange(len(k))[None, :]
        hidden = k_pos > q_pos
        if window:
            hidden |= q_pos - k_pos >= window
        if chunk:
            hidden |= k_pos // chunk != q_pos // chunk
        scores = scores.masked_fill(hidden, -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(out)


def max_error(
    case: PagedCase,
    kernel=attention_triton.paged_attention,
    window=None,
    softcap=None,
    splits=None,
    chunk=None,
) -> float:
    got = kernel(
        case.q,
        case.k_cache,
        case.v_cache,
        case.metadata(),
        None,
        sliding_window=window,
        softcap=softcap,
        num_kv_splits=splits,
        chunk=chunk,
    )
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    return (got.float() - reference(case, window, softcap, chunk)).abs().max().item()


def test_kernel_equals_the_dense_oracle_on_200_random_paged_batches():
    failures = []
    for seed in range(NUM_CASES):
        case = paged_case(seed)
        err = max_error(case)
        if not err <= TOLERANCE[case.q.dtype]:  # NaN fails too
            failures.append((seed, err))
    assert failures == []


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (12, 5.0)])
def test_sliding_window_and_softcap_equal_the_oracle(window, softcap):
    for seed in range(0, 24, 2):  # float32 cases
        case = paged_case(seed)
        assert max_error(case, window=window, softcap=softcap) <= 2e-5, seed


@pytest.mark.parametrize(
    "chunk,window,splits", [(1, None, None), (5, None, None), (16, 9, None), (11, None, 3)]
)
def test_chunked_local_attention_equals_the_oracle(chunk, window, splits):
    for seed in range(0, 8 if splits else 24, 2):  # float32 cases (split-KV: slower)
        case = paged_case(seed)
        err = max_error(case, window=window, splits=splits, chunk=chunk)
        assert err <= 2e-5, seed


@pytest.mark.parametrize("splits", [2, 5])
def test_split_kv_equals_the_oracle(splits):
    """Contexts cut into ranges by separate programs, merged by a second kernel;
    some splits get no keys at all (short contexts)."""
    for seed in (0, 3, 5, 6):  # both dtypes, decode and prefill, GQA 8, 1, 3
        case = paged_case(seed)
        assert max_error(case, splits=splits) <= TOLERANCE[case.q.dtype], seed
    assert max_error(paged_case(2), window=9, softcap=3.0, splits=splits) <= 2e-5


@pytest.mark.parametrize(
    "correct,broken",
    [
        # Mutants keep their reads inside the tensors: the interpreter has no bounds checks.
        ("table + offs_n // BLOCK_SIZE,", "table + tl.maximum(offs_n // BLOCK_SIZE - 1, 0),"),
        ("seq * stride_bt", "(seq + 1) % num_seqs * stride_bt"),  # another request's row
        ("(offs_n % BLOCK_SIZE) * stride_ks", "((offs_n + 1) % BLOCK_SIZE) * stride_ks"),
        ("offs_n[None, :] <= q_pos[:, None]", "offs_n[None, :] < q_pos[:, None]"),  # not causal
    ],
    ids=["block-offset", "table-row", "slot-offset", "causal-mask"],
)
def test_a_broken_kernel_fails_the_comparison(tmp_path, correct, broken):
    """The oracle catches a kernel that reads the wrong block or slot or masks
    off its own key: a mutant of the module's source fails on these batches."""
    source = open(attention_triton.__file__).read()
    assert source.count(correct) == 1
    path = tmp_path / "mutant_attention_triton.py"
    path.write_text(source.replace(correct, broken))
    spec = importlib.util.spec_from_file_location("mutant_attention_triton", path)
    mutant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutant)
    cases = [paged_case(seed) for seed in range(0, 40, 2)]
    cases = [case for case in cases if len(case.seq_lens) > 1][:4]
    assert max(max_error(case, mutant.paged_attention) for case in cases) > 0.1


def test_llm_on_the_triton_backend_gives_transformers_greedy_tokens(
    tiny_qwen3_path, prompts, hf_greedy
):
    """Chunked prefill (16-token budget) and mixed steps, in float32."""
    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    llm = LLM(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        num_gpu_blocks=32,
        max_num_batched_tokens=16,
        async_scheduling=False,
    )
    assert llm.executor.worker.model_runner.attention_backend == "triton"
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    chosen = [prompts[1], prompts[3]]  # 7 and 33 tokens
    results = llm.generate([{"prompt_token_ids": p} for p in chosen], greedy)
    assert [r.token_ids for r in results] == [hf_greedy(p, 5) for p in chosen]


def test_benchmark_decode_runs_on_cpu_and_both_paths_agree():
    from tokenbudget.worker.attention_bench import benchmark_decode

    result = benchmark_decode(
        batch_size=2,
        context_len=40,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device="cpu",
        iters=1,
        warmup=0,
    )
    assert result["max_abs_diff"] < 1e-5
    assert result["triton_ms"] > 0 and result["sdpa_gather_ms"] > 0 and result["speedup"] > 0
