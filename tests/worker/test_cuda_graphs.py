"""Decode CUDA graphs (worker/cuda_graphs.py) checked on CPU: which bucket a
step takes, what the static buffers hold (the real rows exactly the eager
inputs, padding only in the null block), and that replaying the "graph" (the
capture stubbed by a function that runs the forward on the static buffers)
gives the eager logits and tokens. Only the CUDA capture itself is stubbed."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenbudget.core import (
    CacheConfig,
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.server.engine.args import EngineArgs
from tokenbudget.server.entrypoints import cli
from tokenbudget.worker import attention
from tokenbudget.worker.cuda_graph_sizes import DEFAULT_CAPTURE_SIZES, bucket_for, capture_sizes
from tokenbudget.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs, graphs_off_reason
from tokenbudget.worker.model_runner import ModelRunner

BS = 4
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


def no_capture(fn):
    """The stub of the CUDA capture: replaying runs the forward again."""
    return fn


# -- bucket choice -------------------------------------------------------------------------


def test_smallest_bucket_holding_the_batch_is_chosen():
    sizes = DEFAULT_CAPTURE_SIZES
    assert [bucket_for(sizes, np.ones(n, np.int64)) for n in (1, 2, 3, 5, 64, 65, 256)] == [
        1,
        2,
        4,
        8,
        64,
        128,
        256,
    ]


def test_no_bucket_past_the_largest_or_for_a_step_that_is_not_decode_only():
    sizes = (1, 2, 4)
    assert bucket_for(sizes, np.ones(5, np.int64)) is None
    assert bucket_for(sizes, np.array([1, 7])) is None  # a prompt chunk
    assert bucket_for(sizes, np.array([1, 3])) is None  # a spec-decode verify (2 drafts)
    assert bucket_for(sizes, np.array([], np.int64)) is None


def test_capture_sizes_from_either_spelling():
    assert capture_sizes() == DEFAULT_CAPTURE_SIZES
    assert capture_sizes(["8", "1", "2,4"]) == (1, 2, 4, 8)
    assert capture_sizes("16 4") == (4, 16)
    assert capture_sizes(max_bs=48) == (1, 2, 4, 8, 16, 32, 48)
    for bad in (dict(sizes=["0"]), dict(sizes="x"), dict(sizes=[1], max_bs=4), dict(max_bs=0)):
        with pytest.raises(ValueError):
            capture_sizes(**bad)


def test_flags_reach_the_engine_args():
    def parse(*argv):
        return cli.engine_args_from(cli.build_parser().parse_args(list(argv)))

    assert parse("--cuda-graph-sizes", "1", "2", "8").cuda_graph_sizes == [1, 2, 8]
    assert parse("--cuda-graph-max-bs", "24").cuda_graph_sizes == [1, 2, 4, 8, 16, 24]
    assert parse().cuda_graph_sizes == list(DEFAULT_CAPTURE_SIZES)
    with pytest.raises(ValueError, match="not both"):
        EngineArgs.from_kwargs(None, cuda_graph_sizes=[1], cuda_graph_max_bs=4)


def test_llm_keyword_reaches_the_runner(tiny_qwen3_path):
    from tokenbudget.server import LLM

    llm = LLM(tiny_qwen3_path, device="cpu", num_gpu_blocks=32, cuda_graph_max_bs=3)
    try:
        runner = llm.executor.worker.model_runner
        assert runner.cuda_graph_sizes == [1, 2, 3]
        assert runner.cuda_graphs is None  # CPU: no capture
    finally:
        llm.shutdown()


# -- static buffers ------------------------------------------------------------------------


def graphs_with_buffers(width: int = 6) -> DecodeGraphs:
    g = DecodeGraphs((1, 2, 4, 8), 8, width, BS, "ref", [], torch.device("cpu"))
    g.capture(lambda ids, pos, keep, meta: ids, no_capture)
    return g


def decode(input_ids: np.ndarray, positions: np.ndarray) -> types.SimpleNamespace:
    """The StepInputs fields prepare reads, for a decode-only step."""
    return types.SimpleNamespace(
        input_ids=input_ids, positions=positions, query_lens=np.ones(len(input_ids), np.int64)
    )


def test_real_rows_hold_the_eager_inputs_and_padding_only_the_null_block():
    g = graphs_with_buffers()
    ids, pos = np.array([11, 12, 13]), np.array([5, 17, 2])
    seq_lens = pos + 1
    tables = np.array([[3, 4, 0, 0, 0, 0], [5, 6, 7, 8, 9, 0], [10, 0, 0, 0, 0, 0]], np.int32)
    slots = tables[np.arange(3), pos // BS] * BS + pos % BS
    meta = g.prepare(decode(ids, pos), seq_lens, tables, slots)
    assert meta is g.metas[4] and g.owns(meta)
    assert g.input_ids[:3].tolist() == ids.tolist() and g.positions[:3].tolist() == pos.tolist()
    assert g.seq_lens[:3].tolist() == seq_lens.tolist()
    assert g.slot_mapping[:3].tolist() == slots.tolist()
    assert g.block_tables[:3].tolist() == tables.tolist()
    # The padding row: a one-token context read from and written to block 0.
    assert (g.seq_lens[3].item(), g.slot_mapping[3].item(), g.input_ids[3].item()) == (1, 0, 0)
    assert not g.block_tables[3].any()
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_start_loc.tolist() == np.cumsum([0, *seq_lens, 1]).tolist()
    assert meta.max_query_len == 1 and meta.max_seq_len == 6 * BS
    # A smaller step later leaves no stale row of the bigger one in its bucket.
    meta = g.prepare(decode(ids[:1], pos[:1]), seq_lens[:1], tables[:1], slots[:1])
    assert meta is g.metas[1] and g.block_tables[:1].tolist() == tables[:1].tolist()


def test_prepare_declines_what_no_graph_holds():
    g = graphs_with_buffers()
    one = np.ones(9, np.int64)
    tables = np.zeros((9, 6), np.int32)
    assert g.prepare(decode(one, one), one + 1, tables, one) is None  # 9 > the largest bucket
    chunk = decode(np.arange(3), np.arange(3))
    chunk.query_lens = np.array([3])
    assert g.prepare(chunk, np.array([3]), tables[:1], np.arange(3)) is None  # a prompt chunk


def test_buckets_above_max_num_seqs_stop_at_the_one_holding_it():
    g = DecodeGraphs(DEFAULT_CAPTURE_SIZES, 40, 4, BS, "ref", [], torch.device("cpu"))
    assert g.sizes == (1, 2, 4, 8, 16, 32, 64)


def test_graphs_are_off_on_cpu_and_with_enforce_eager():
    runner = types.SimpleNamespace(
        enforce_eager=False,
        device=torch.device("cpu"),
        vision=None,
        parallel=None,
        attention_backend="sdpa",
    )
    assert graphs_off_reason(runner) == "device cpu"
    runner.enforce_eager = True
    assert graphs_off_reason(runner) == "enforce_eager"
    runner.enforce_eager, runner.device = False, torch.device("cuda")
    assert "sdpa" in graphs_off_reason(runner)  # plans on the host: not capturable


# -- replay equals eager -------------------------------------------------------------------


def reference_paged_attention(q, k_cache, v_cache, meta, scale):
    """A naive in-place backend: reads only meta's tensors, as a graph would."""
    bs, out = k_cache.shape[1], torch.empty_like(q)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        blocks = meta.block_tables[i, : -(-seq_len // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        v = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        qi = q[starts[i] : starts[i + 1]].transpose(0, 1)
        n = qi.shape[1]
        mask = torch.ones(n, seq_len, dtype=torch.bool).tril(seq_len - n)
        res = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[i] : starts[i + 1]] = res.transpose(0, 1)
    return out


@pytest.fixture
def ref_backend(monkeypatch):
    module = types.ModuleType("tokenbudget_test_ref_attention")
    module.paged_attention = reference_paged_attention
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(attention._PAGED_KERNEL_MODULES, "ref", module.__name__)
    return "ref"


def make_runner(path: str, backend: str, graphs: bool) -> ModelRunner:
    r = ModelRunner(path, dtype="float32", device="cpu", attention_backend="sdpa")
    r.attention_backend = backend
    r.cuda_graph_sizes = [1, 2, 4, 8]
    r.initialize_kv_cache(
        CacheConfig(block_size=BS, num_blocks=64), SchedulerConfig(max_num_seqs=8, max_model_len=64)
    )
    if graphs:
        r.cuda_graphs = capture_decode_graphs(r, 8, capture=no_capture)
    logits = []
    forward = r._forward
    r._forward = lambda *a: logits.append(forward(*a)) or logits[-1]
    r.logits = logits
    return r


def decode_step(reqs: dict[str, int]) -> SchedulerOutput:
    data = CachedRequestData()
    for rid, computed in reqs.items():
        data.req_ids.append(rid)
        data.new_block_ids.append([])
        data.num_computed_tokens.append(computed)
    n = {rid: 1 for rid in reqs}
    return SchedulerOutput([], data, n, len(n))


def test_replay_gives_the_eager_logits_tokens_and_kv(tiny_qwen3_path, ref_backend, prompts):
    ps = [prompts[0], prompts[1], prompts[2]]  # 3, 7 and 16 tokens: bucket 4, one padding row
    runs = {}
    for graphs in (False, True):
        r = make_runner(tiny_qwen3_path, ref_backend, graphs)
        new = [
            NewRequestData(f"r{i}", p, [], GREEDY, list(range(1 + 6 * i, 7 + 6 * i)), 0)
            for i, p in enumerate(ps)
        ]
        first = SchedulerOutput(
            new,
            CachedRequestData(),
            {n.req_id: len(n.prompt_token_ids) for n in new},
            sum(map(len, ps)),
        )
        outs = [r.execute_model(first)]
        for k in range(5):
            outs.append(
                r.execute_model(decode_step({f"r{i}": len(p) + k for i, p in enumerate(ps)}))
            )
        runs[graphs] = (r, [o.sampled_token_ids for o in outs])
    (eager, eager_tokens), (graphed, graph_tokens) = runs[False], runs[True]
    assert graphed.cuda_graphs.num_replays == 5  # every decode step replayed, the prefill did not
    assert graph_tokens == eager_tokens
    for a, b in zip(eager.logits, graphed.logits):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager.kv_caches, graphed.kv_caches):  # real blocks equal; padding hit block 0
        torch.testing.assert_close(a[:, 1:], b[:, 1:], rtol=1e-5, atol=1e-5)
