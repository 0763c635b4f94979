"""KV cache sizing. On CPU: kv_cache_memory (``--kv-cache-memory``) buys
exactly as many blocks as fit, computed here from the checkpoint's config.
On a GPU, checked here with a faked device: after a profile forward of a full
token budget, the cache gets ``total * gpu_memory_utilization - peak`` bytes
(``torch.cuda``'s memory queries are faked; the forward runs for real)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from tokenbudget.core import CacheConfig, SchedulerConfig
from tokenbudget.server import LLM
from tokenbudget.worker.model_runner import ModelRunner


def _bytes_per_block(path: str, block_size: int) -> int:
    """K and V, every layer, float32: from the config, not from our code."""
    cfg = AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


def test_kv_cache_memory_sets_the_number_of_blocks(tiny_qwen3_path):
    per_block = _bytes_per_block(tiny_qwen3_path, 16)
    llm = LLM(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        kv_cache_memory="1MiB",
        async_scheduling=False,
    )
    try:
        assert llm.cache_config.num_blocks == (1 << 20) // per_block
        pool = llm.engine.scheduler.kv_cache_manager.block_pool
        assert pool.num_blocks == llm.cache_config.num_blocks
        caches = llm.engine.executor.worker.model_runner.kv_caches
        assert (
            sum(c.numel() * c.element_size() for c in caches)
            == llm.cache_config.num_blocks * per_block
            <= 1 << 20
        )
    finally:
        llm.shutdown()


def test_cpu_default_is_what_max_num_seqs_requests_at_max_model_len_need(tiny_qwen3_path):
    runner = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu")
    sched = SchedulerConfig(max_num_seqs=3, max_model_len=100)
    # Blocks for max_model_len + 1 tokens per sequence, plus the null block.
    assert runner.initialize_kv_cache(CacheConfig(block_size=16), sched) == 3 * 7 + 1


def test_a_kv_cache_memory_too_small_for_two_blocks_is_refused(tiny_qwen3_path):
    runner = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu")
    per_block = _bytes_per_block(tiny_qwen3_path, 16)
    with pytest.raises(ValueError, match="KV cache too small"):
        runner.initialize_kv_cache(
            CacheConfig(kv_cache_memory_bytes=2 * per_block - 1), SchedulerConfig()
        )
    # Today the floor is two blocks (the null block and one more); a cache that
    # cannot hold one max_model_len request is not refused yet (issue 16).
    assert (
        runner.initialize_kv_cache(
            CacheConfig(kv_cache_memory_bytes=2 * per_block), SchedulerConfig(max_model_len=4096)
        )
        == 2
    )


GiB = 1 << 30


class FakeCudaMemory:
    """The torch.cuda calls the profile makes, recording their order."""

    def __init__(self, total: int, peak: int) -> None:
        self.total, self.peak = total, peak
        self.events: list[str] = []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda device=None: (self.total - self.peak, self.total)
        )
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self._max_allocated)
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda device=None: self.events.append("reset")
        )
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def _max_allocated(self, device=None) -> int:
        self.events.append("peak")
        return self.peak


@pytest.fixture
def runner(tiny_qwen3_path) -> ModelRunner:
    runner = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu")
    forward = runner.model.forward

    def recording_forward(*args, **kwargs):
        runner.profiled_shapes.append(tuple(kwargs["input_ids"].shape))
        fake.events.append("forward")
        return forward(*args, **kwargs)

    fake = FakeCudaMemory(total=80 * GiB, peak=3 * GiB)
    runner.fake_cuda = fake
    runner.profiled_shapes = []
    runner.model.forward = recording_forward
    return runner


@pytest.mark.parametrize("budget,max_model_len", [(512, 4096), (8192, 300)])
def test_profile_runs_a_full_budget_forward_then_leaves_the_rest_for_kv(
    runner, monkeypatch, budget, max_model_len
):
    runner.fake_cuda.install(monkeypatch)
    free = runner._profile_free_memory(
        CacheConfig(gpu_memory_utilization=0.9),
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len),
    )
    assert free == int(80 * GiB * 0.9) - 3 * GiB
    # One forward of the step's largest token count (capped by max_model_len),
    # with the peak reset before it and read after it.
    assert runner.profiled_shapes == [(1, min(budget, max_model_len))]
    assert runner.fake_cuda.events == ["reset", "forward", "peak"]


def test_a_peak_above_the_utilisation_share_leaves_nothing(runner, monkeypatch):
    runner.fake_cuda.peak = 79 * GiB
    runner.fake_cuda.install(monkeypatch)
    assert (
        runner._profile_free_memory(
            CacheConfig(gpu_memory_utilization=0.9), SchedulerConfig(max_num_batched_tokens=64)
        )
        == 0
    )
