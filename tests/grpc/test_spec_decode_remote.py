"""Speculative decoding across the worker protocol: the speculative config reaches a
gRPC worker in Initialize, its drafts travel back in ModelRunnerOutput, and the
acceptance counters reach GetStats and Prometheus."""

from __future__ import annotations

import gc

import pytest

from tokenbudget.core import CacheConfig, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.server.engine.async_engine import AsyncEngine

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(40, 90)), [7, 8, 9, 10] * 6, [300, 301, 302]]


@pytest.fixture
def remote_worker():
    """A worker servicer on loopback gRPC (in this process; Initialize tunes the
    collector, which is put back afterwards)."""
    from tokenbudget.worker.grpc_worker import serve

    thresholds = gc.get_threshold()
    server, port, _ = serve("127.0.0.1", 0)
    yield f"127.0.0.1:{port}"
    server.stop(0)
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_remote_worker_drafts_and_stats_reach_getstats_and_prometheus(
    tiny_model, oracle, remote_worker, serving, overlap_recorder, async_scheduling
):
    from tokenbudget.server.engine.input_processor import InputProcessor
    from tokenbudget.server.engine.metrics import EngineMetrics
    from tokenbudget.server.executor.remote import RemoteExecutor

    executor = overlap_recorder(
        RemoteExecutor(
            [remote_worker], tiny_model, dtype="float32", device="cpu", attention_backend="sdpa"
        )
    )
    core = EngineCore(
        SchedulerConfig(
            max_num_batched_tokens=64, speculative_config=SPEC, async_scheduling=async_scheduling
        ),
        CacheConfig(num_blocks=256),
        executor,
    )
    metrics = EngineMetrics("tiny")
    engine = AsyncEngine(
        core, InputProcessor.from_pretrained(tiny_model), metrics, model_name="tiny"
    )
    want = [
        r.token_ids for r in oracle.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    ]
    with serving(engine) as client:
        got = [client.generate({"token_ids": p}, GREEDY).token_ids for p in PROMPTS]
        stats = client.stats()
    metrics.close()
    assert got == want
    # Async overlaps the steps that verify no drafts; a step verifying drafts runs alone.
    assert (executor.num_overlapped_steps > 0) is async_scheduling
    assert executor.drafted and executor.num_steps_beside_drafts == 0
    spec = core.scheduler.make_stats().spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # drafts came from the worker
    assert (
        stats.spec_num_drafts,
        stats.spec_num_draft_tokens,
        stats.spec_num_accepted_tokens,
        list(stats.spec_accepted_per_position),
    ) == (
        spec.num_drafts,
        spec.num_draft_tokens,
        spec.num_accepted_tokens,
        spec.accepted_per_position,
    )
    assert stats.spec_mean_accepted_length == pytest.approx(
        1 + spec.num_accepted_tokens / spec.num_drafts
    )
    sample = metrics.registry.get_sample_value
    labels = {"model_name": "tiny"}
    assert sample("tokenbudget:spec_decode_num_drafts_total", labels) == spec.num_drafts
    assert (
        sample("tokenbudget:spec_decode_num_accepted_tokens_total", labels)
        == spec.num_accepted_tokens
    )
    assert sample("tokenbudget:spec_decode_num_draft_tokens_total", labels) == spec.num_draft_tokens
    assert [
        sample(
            "tokenbudget:spec_decode_num_accepted_tokens_per_pos_total",
            {**labels, "position": str(i)},
        )
        for i in range(len(spec.accepted_per_position))
    ] == spec.accepted_per_position
