"""ModelRunner driven by hand-built SchedulerOutputs: the persistent batch
follows finish / preempt / resume deltas, and speculative drafts are verified."""

from __future__ import annotations

import pytest

from tokenbudget.core import (
    CacheConfig,
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.worker.model_runner import ModelRunner

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
BS = 4


@pytest.fixture
def runner(tiny_qwen3_path):
    r = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu", attention_backend="sdpa")
    r.initialize_kv_cache(
        CacheConfig(block_size=BS, num_blocks=64),
        SchedulerConfig(max_num_seqs=4, max_model_len=256),
    )
    return r


def blocks(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // BS)))


def step(new=(), cached=(), finished=(), preempted=(), spec=None):
    """new: NewRequestData list; cached: (req_id, new_block_ids, num_computed, num_sched,
    resumed_token_ids or None) tuples."""
    data = CachedRequestData()
    num_sched = {n.req_id: len(n.prompt_token_ids) - n.num_computed_tokens for n in new}
    for rid, block_ids, computed, n, resumed in cached:
        data.req_ids.append(rid)
        data.new_block_ids.append(block_ids)
        data.num_computed_tokens.append(computed)
        if resumed is not None:
            data.resumed_token_ids[rid] = resumed
        num_sched[rid] = n
    return SchedulerOutput(
        list(new),
        data,
        num_sched,
        sum(num_sched.values()),
        scheduled_spec_decode_tokens=spec or {},
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def sampled(out, rid):
    return out.sampled_token_ids[out.req_id_to_index[rid]]


def test_finish_preempt_and_resume_keep_the_batch_consistent(runner, prompts, hf_greedy_16):
    pa, pb = prompts[1], prompts[3]  # 7 and 33 tokens
    ref_a, ref_b = hf_greedy_16[1], hf_greedy_16[3]
    out = runner.execute_model(
        step(
            new=[
                NewRequestData("a", pa, [], GREEDY, blocks(1, 12), 0),
                NewRequestData("b", pb, [], GREEDY, blocks(10, 36), 0),
            ]
        )
    )
    assert sampled(out, "a") == ref_a[:1] and sampled(out, "b") == ref_b[:1]
    out = runner.execute_model(step(cached=[("a", [], 7, 1, None), ("b", [], 33, 1, None)]))
    assert sampled(out, "a") == ref_a[1:2] and sampled(out, "b") == ref_b[1:2]
    # b is preempted: its row is freed, a keeps decoding alone.
    out = runner.execute_model(step(cached=[("a", [], 8, 1, None)], preempted=["b"]))
    assert out.req_ids == ["a"] and sampled(out, "a") == ref_a[2:3]
    assert runner.requests["b"].row is None
    # b resumes on different blocks and recomputes prompt + its 2 outputs.
    resumed = pb + ref_b[:2]
    out = runner.execute_model(
        step(cached=[("a", [], 9, 1, None), ("b", blocks(30, 40), 0, len(resumed), resumed)])
    )
    assert sampled(out, "a") == ref_a[3:4] and sampled(out, "b") == ref_b[2:3]
    # a finishes; b keeps decoding from its worker-side tokens.
    for i in range(3):
        out = runner.execute_model(
            step(cached=[("b", [], len(resumed) + i, 1, None)], finished=["a"] if i == 0 else ())
        )
        assert sampled(out, "b") == ref_b[3 + i : 4 + i]
    assert set(runner.requests) == {"b"}
    assert len(runner.batch._free_rows) == runner.batch.capacity - 1


def test_mid_prefill_chunks_sample_nothing_until_the_prompt_is_done(runner, prompts, hf_greedy_16):
    p = prompts[4]  # 64 tokens in chunks of 30, 30, 4
    first = step(new=[NewRequestData("r", p, [], GREEDY, blocks(1, 68), 0)])
    first.num_scheduled_tokens["r"] = 30
    first.total_num_scheduled_tokens = 30
    assert sampled(runner.execute_model(first), "r") == []
    assert sampled(runner.execute_model(step(cached=[("r", [], 30, 30, None)])), "r") == []
    out = runner.execute_model(step(cached=[("r", [], 60, 4, None)]))
    assert sampled(out, "r") == hf_greedy_16[4][:1]


def test_speculative_drafts_accepted_while_they_match_then_corrected(runner, prompts, hf_greedy_16):
    p, ref = prompts[2], hf_greedy_16[2]  # 16 tokens
    runner.execute_model(step(new=[NewRequestData("r", p, [], GREEDY, blocks(1, 40), 0)]))
    wrong = (ref[3] + 1) % runner.vocab_size
    drafts = [ref[1], ref[2], wrong]
    out = runner.execute_model(step(cached=[("r", [], 16, 4, None)], spec={"r": drafts}))
    # Two drafts accepted, the third replaced by the model's own token.
    assert sampled(out, "r") == ref[1:4]
    # The scheduler rolls back the rejected draft; decoding continues correctly
    # over KV slots that the rejected draft had written.
    out = runner.execute_model(step(cached=[("r", [], 19, 1, None)]))
    assert sampled(out, "r") == ref[4:5]
    out = runner.execute_model(step(cached=[("r", [], 20, 3, None)], spec={"r": ref[5:7]}))
    assert sampled(out, "r") == ref[5:8]  # all drafts accepted plus a bonus token


def test_scheduling_past_known_tokens_is_an_error(runner, prompts):
    runner.execute_model(step(new=[NewRequestData("r", prompts[0], [], GREEDY, blocks(1, 8), 0)]))
    with pytest.raises(RuntimeError, match="scheduled past the tokens the worker knows"):
        runner.execute_model(step(cached=[("r", [], 3, 3, None)]))


def test_batch_grows_past_max_num_seqs(tiny_qwen3_path, prompts, hf_greedy_16):
    """Async scheduling may admit requests before the worker hears that others
    finished, so the batch must grow rather than fail."""
    r = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu", attention_backend="sdpa")
    r.initialize_kv_cache(
        CacheConfig(block_size=BS, num_blocks=64), SchedulerConfig(max_num_seqs=1, max_model_len=64)
    )
    out = r.execute_model(
        step(
            new=[
                NewRequestData(f"r{i}", prompts[i], [], GREEDY, blocks(1 + 10 * i, 20), 0)
                for i in range(3)
            ]
        )
    )
    assert r.batch.capacity >= 3
    assert [sampled(out, f"r{i}") for i in range(3)] == [ref[:1] for ref in hf_greedy_16[:3]]


def test_grammar_bitmask_rows_constrain_their_requests_only(runner, prompts, hf_greedy_16):
    import numpy as np

    forced = 77
    words = -(-runner.vocab_size // 32)
    bitmask = np.zeros((1, words), dtype=np.int32)
    bitmask[0, forced // 32] = 1 << (forced % 32)
    so = step(
        new=[
            NewRequestData("free", prompts[0], [], GREEDY, blocks(1, 8), 0),
            NewRequestData("json", prompts[1], [], GREEDY, blocks(3, 12), 0),
        ]
    )
    so.grammar_bitmask, so.structured_req_ids = bitmask, ["json"]
    out = runner.execute_model(so)
    assert sampled(out, "json") == [forced] != hf_greedy_16[1][:1]
    assert sampled(out, "free") == hf_greedy_16[0][:1]
