"""The worker's fast bitmask paths against references: the branchless CPU
masking equals xgrammar's kernel and a bit-by-bit oracle, and the model
runner's in-place path (every row constrained, in order) masks the same rows
as the general mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar

from tokenbudget.core import CacheConfig, NewRequestData, SamplingParams, SchedulerConfig
from tokenbudget.core.outputs import CachedRequestData, SchedulerOutput
from tokenbudget.worker import sampler
from tokenbudget.worker.sampler import apply_token_bitmask_cpu


def _bitmask(rows: int, vocab: int, seed: int) -> np.ndarray:
    """Rows of every kind a grammar produces: random bits, mostly forbidding,
    mostly allowing, allowing all, forbidding all; ragged padding words."""
    rng = np.random.default_rng(seed)
    words = -(-vocab // 32) + 1  # one spare word past the vocabulary
    mask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    kinds = rng.integers(0, 5, size=rows)
    for r, kind in enumerate(kinds):
        if kind == 1:
            mask[r, 1:] = 0
        elif kind == 2:
            mask[r, :] = -1
            mask[r, rng.integers(0, words - 1)] = 0
        elif kind == 3:
            mask[r, :] = -1
        elif kind == 4:
            mask[r, :] = 0
    return mask


def _naive(logits: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,chunk", [(96, 1 << 18), (100, 1 << 18), (1000, 2500)])
def test_cpu_masking_equals_xgrammar_kernel_and_naive(monkeypatch, dtype, vocab, chunk):
    # A small chunk splits the rows into several chunks (the last one short).
    monkeypatch.setattr(sampler, "_CPU_CHUNK", chunk)
    rows = 11
    mask = _bitmask(rows, vocab, seed=vocab)
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3).to(
        dtype
    )
    ours, kernel = logits.clone(), logits.clone()
    apply_token_bitmask_cpu(ours, torch.from_numpy(mask))
    xgrammar.apply_token_bitmask_inplace(kernel, torch.from_numpy(mask), vocab_size=vocab)
    expected = _naive(logits, mask)
    assert torch.equal(kernel, expected)
    assert torch.equal(ours, expected)


def test_cpu_masking_of_all_allowing_rows_leaves_logits_untouched():
    logits = torch.randn(4, 70)
    masked = logits.clone()
    apply_token_bitmask_cpu(masked, torch.full((4, 3), -1, dtype=torch.int32))
    assert torch.equal(masked, logits)


def test_cpu_masking_skips_rows_that_allow_all_and_masks_the_others():
    vocab = 64
    mask = np.full((5, 2), -1, dtype=np.int32)
    mask[[1, 3]] = _bitmask(2, vocab, seed=3)[:, :2]
    logits = torch.randn(5, vocab)
    masked = logits.clone()
    apply_token_bitmask_cpu(masked, torch.from_numpy(mask))
    assert torch.equal(masked, _naive(logits, mask))


def test_cpu_masking_of_a_non_contiguous_view():
    vocab = 80
    mask = _bitmask(6, vocab, seed=9)
    base = torch.randn(vocab, 6)
    logits = base.t()  # rows strided
    masked = logits.clone()  # contiguous copy as the expectation's input
    apply_token_bitmask_cpu(logits, torch.from_numpy(mask))
    assert torch.equal(logits, _naive(masked, mask))


@pytest.fixture(scope="module")
def runner(tiny_model):
    from tokenbudget.worker.model_runner import ModelRunner

    r = ModelRunner(tiny_model, dtype="float32", device="cpu", attention_backend="sdpa")
    r.initialize_kv_cache(
        CacheConfig(block_size=16, num_blocks=64),
        SchedulerConfig(max_num_seqs=8, max_model_len=256),
    )
    return r


def _forcing(vocab: int, tokens: list[int]) -> np.ndarray:
    mask = np.zeros((len(tokens), -(-vocab // 32)), dtype=np.int32)
    for row, t in enumerate(tokens):
        mask[row, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


@pytest.mark.parametrize("order", [["a", "b", "c"], ["c", "a", "b"]])
def test_every_row_constrained_masks_each_request_with_its_own_row(runner, order):
    """Scheduled order a, b, c; bitmask rows in ``order``: the first is the
    in-place path, the second the general mapping. Each request gets the
    token its own row forces (greedy), including bit 31 (a negative word)."""
    forced = {"a": 31, "b": 77, "c": 200}
    greedy = SamplingParams(temperature=0.0)
    new = [
        NewRequestData(rid, [5 + i, 9, 13, 21], [], greedy, [1 + i], 0)
        for i, rid in enumerate("abc")
    ]
    so = SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={rid: 4 for rid in "abc"},
        total_num_scheduled_tokens=12,
    )
    so.grammar_bitmask = _forcing(runner.vocab_size, [forced[r] for r in order])
    so.structured_req_ids = list(order)
    out = runner.execute_model(so)
    got = {rid: out.sampled_token_ids[out.req_id_to_index[rid]] for rid in "abc"}
    runner.execute_model(
        SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=set("abc"),
        )
    )
    assert got == {rid: [t] for rid, t in forced.items()}
