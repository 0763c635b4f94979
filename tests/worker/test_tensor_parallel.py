"""LLM(tensor_parallel_size=2): two real rank processes (gloo on CPU) give the
greedy tokens of transformers generate() and of tensor_parallel_size=1, with
chunked prefill, prefix-cache hits, preemption and async scheduling; the KV
cache is sharded by KV heads (twice the blocks in the same per-rank memory)."""

from __future__ import annotations

import pytest

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM
from tokenbudget.worker.attention import kv_cache_bytes_per_block

# Per rank; TP=2 holds 1 of the tiny Qwen3's 2 KV heads, so twice the blocks
# fit: few enough that the workload below preempts.
KV_MEMORY = 28 * kv_cache_bytes_per_block(2, 4, 2, 16, __import__("torch").float32)
ENGINE_ARGS = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    kv_cache_memory=KV_MEMORY,
    max_num_batched_tokens=32,
    max_num_seqs=8,
)


@pytest.fixture(scope="module")
def tp_llm(tiny_qwen3_path):
    llm = LLM(tiny_qwen3_path, tensor_parallel_size=2, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp1_llm(tiny_qwen3_path):
    llm = LLM(tiny_qwen3_path, **dict(ENGINE_ARGS, kv_cache_memory=None, num_gpu_blocks=2 * 28))
    yield llm
    llm.shutdown()


def test_tp2_greedy_equals_tp1_and_transformers(tp_llm, tp1_llm, prompts, hf_greedy_16):
    prompts, expected = prompts[:6], hf_greedy_16[:6]  # 3 to 100 tokens
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = tp_llm.engine
    assert engine.async_scheduling
    # KV sharded by KV heads: the same per-rank memory holds twice the blocks.
    assert tp_llm.cache_config.num_blocks == 2 * 28
    first = tp_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.token_ids for r in first] == expected
    assert engine.scheduler.make_stats().num_preemptions > 0
    again = tp_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.token_ids for r in again] == expected
    assert sum(r.num_cached_tokens for r in again) > 0  # prefix hits
    assert [
        r.token_ids for r in tp1_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ] == expected
    engine.scheduler.kv_cache_manager.block_pool.check_invariants()


def test_tp2_random_sampling_keeps_the_ranks_in_step(tp_llm, tp1_llm, prompts):
    """Every rank samples and feeds its own token back; only rank 0 answers.
    Unseeded requests draw from the global generator, which rank 0 seeds
    alike on every rank. Had another rank drawn a different token, its half
    of the KV would describe another sequence, and rank 0's logprobs of the
    tokens it returned would differ from the same tokens teacher-forced
    through TP=1."""
    prompt = prompts[3]
    sampled = tp_llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, ignore_eos=True),
    )[0]
    forced = tp1_llm.generate(
        {"prompt_token_ids": prompt + sampled.token_ids},
        SamplingParams(max_tokens=1, prompt_logprobs=0),
    )[0]
    got = [lp[t] for lp, t in zip(sampled.logprobs, sampled.token_ids)]
    want = [lp[t] for lp, t in zip(forced.prompt_logprobs[len(prompt) :], sampled.token_ids)]
    assert got == pytest.approx(want, abs=1e-4)


def test_tp2_vision_language_greedy_equals_tp1_and_transformers(tmp_path_factory, vl_chats):
    """The vision tower runs replicated on each rank; the language model is
    sharded by Qwen2.5-VL's plan. Chunks start and end inside images, the
    second chat's image is the first chat's second (an encoder-cache hit),
    19 blocks of 4 tokens preempt one chat, and the second round hits the
    prefix cache; async scheduling is on."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tokenbudget.server.engine.mm_processor import MultiModalProcessor
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl, hf_generate_vl_ids

    path = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tp_qwen2_5_vl"))
    processor = MultiModalProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    expected = [
        hf_generate_vl_ids(model, *processor.process_messages(chat), 8, ignore_eos=True)
        for chat in vl_chats
    ]
    del model
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    chats = [{"messages": c} for c in vl_chats]
    args = dict(
        dtype="float32", device="cpu", block_size=4, num_gpu_blocks=19, max_num_batched_tokens=16
    )
    tp1 = LLM(path, **args)
    try:
        assert [r.token_ids for r in tp1.generate(chats, params)] == expected
    finally:
        tp1.shutdown()
    llm = LLM(path, tensor_parallel_size=2, **args)
    try:
        assert llm.engine.async_scheduling
        first = llm.generate(chats, params)
        preemptions = llm.engine.scheduler.make_stats().num_preemptions
        again = llm.generate(chats, params)
        llm.engine.scheduler.kv_cache_manager.block_pool.check_invariants()
    finally:
        llm.shutdown()
    assert [r.token_ids for r in first] == expected
    assert preemptions > 0
    assert [r.token_ids for r in again] == expected
    assert all(r.num_cached_tokens > 0 for r in again)  # prefix hits, images included


def test_a_size_that_does_not_divide_the_kv_heads_is_refused_before_any_rank_starts(
    tiny_qwen3_path, monkeypatch
):
    from tokenbudget.server.executor import tensor_parallel as launcher

    monkeypatch.setattr(launcher, "LocalRanks", None)  # starting a rank would raise TypeError
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=4 does not divide the model's "
        "num_key_value_heads=2; pick a size that divides it",
    ):
        LLM(tiny_qwen3_path, tensor_parallel_size=4)


def test_idle_ranks_outlive_the_collective_timeout_and_stop_in_order():
    """Between steps the other ranks wait in a broadcast bounded by the
    timeout; rank 0's heartbeats keep an idle group alive past it. SIGTERM to
    rank 0 then stops every rank with status 0."""
    import signal
    import time

    from tokenbudget.server.executor.tensor_parallel import LocalRanks

    ranks = LocalRanks(2, dist_timeout_s=1.0)
    try:
        time.sleep(3.0)  # no model, no step: only heartbeats cross the group
        assert [p.poll() for p in ranks.procs] == [None, None]
        ranks.procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(15) for p in ranks.procs] == [0, 0]
    finally:
        ranks.stop()


def test_a_killed_rank_fails_the_step_with_the_reason_and_a_fresh_group_recovers(
    tp_llm, prompts, hf_greedy_16
):
    """Kept last: it breaks tp_llm's group. The step fails at once (the dead
    rank's sockets close), rank 0 leaves the group, and the reconnection the
    server's engine makes with backoff (discard, reinitialize) starts a fresh
    group that generates the same tokens."""
    import time

    from tokenbudget.server.executor.remote import WorkerUnavailableError

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    old = tp_llm.executor.ranks.procs
    old[1].kill()
    start = time.monotonic()
    with pytest.raises(WorkerUnavailableError, match="tensor-parallel group broken"):
        tp_llm.generate({"prompt_token_ids": prompts[2]}, params)
    assert time.monotonic() - start < 10
    assert old[0].wait(15) == 1  # rank 0 left the broken group
    tp_llm.engine.discard_requests()
    tp_llm.engine.reinitialize()
    assert tp_llm.executor.ranks.procs[0] is not old[0]
    got = tp_llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params)
    assert [r.token_ids for r in got] == hf_greedy_16[:3]
