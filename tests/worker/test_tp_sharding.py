"""Tensor-parallel sharding by the models' transformers plans, checked in one
process: two copies of a model, each cut to one rank's shards, run side by
side in two threads whose all-reduce is a barrier that sums their partial
outputs. Their logits must equal the whole model's (the oracle); a rank that
skipped the all-reduce, or cut a layer the wrong way, would not."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from tokenbudget.worker.parallel.sharding import (
    ColumnParallelLinear,
    RowParallelLinear,
    check_tensor_parallel_size,
    find_decoder,
    shard_model,
)
from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl


class ThreadAllReduce:
    """The all-reduce of ranks that are threads: every rank gets the sum, in rank order."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * world_size
        self.calls = 0

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            t.copy_(total)
            if rank == 0:
                self.calls += 1

        return all_reduce


def sharded_logits(model, input_ids: torch.Tensor, world_size: int = 2) -> tuple[list, int]:
    reduce = ThreadAllReduce(world_size)
    shards = []
    for rank in range(world_size):
        net = copy.deepcopy(model)
        shard_model(net, rank, world_size, reduce.for_rank(rank))
        shards.append(net)
    results: list = [None] * world_size

    def run(rank: int) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():
            results[rank] = shards[rank](input_ids=input_ids).logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, reduce.calls


@pytest.fixture(scope="module", params=["qwen3", "qwen2_5_vl", "qwen3_vl"])
def model(request, tiny_qwen3_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if request.param == "qwen3":
        path, cls = tiny_qwen3_path, AutoModelForCausalLM
    else:
        build = build_tiny_qwen2_5_vl if request.param == "qwen2_5_vl" else build_tiny_qwen3_vl
        path, cls = build(tmp_path_factory.mktemp(request.param)), AutoModelForImageTextToText
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_two_rank_shards_give_the_whole_models_logits(model):
    input_ids = torch.arange(20, 60).view(1, -1)
    with torch.inference_mode():
        want = model(input_ids=input_ids).logits
    got, num_reduces = sharded_logits(model, input_ids)
    for logits in got:
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)
    num_layers = model.config.get_text_config().num_hidden_layers
    assert num_reduces == 2 * num_layers  # o_proj and down_proj of every layer


def test_attention_and_mlp_are_cut_by_heads_and_features(model):
    net = copy.deepcopy(model)
    n = shard_model(net, 1, 2, lambda t: None)
    text = model.config.get_text_config()
    layer, whole = find_decoder(net)[1].layers[0], find_decoder(model)[1].layers[0]
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert n == 7 * text.num_hidden_layers
    assert isinstance(layer.self_attn.q_proj, ColumnParallelLinear)
    assert isinstance(layer.mlp.down_proj, RowParallelLinear)
    assert layer.self_attn.q_proj.weight.shape[0] == text.num_attention_heads // 2 * head_dim
    assert layer.self_attn.k_proj.weight.shape[0] == text.num_key_value_heads // 2 * head_dim
    assert layer.self_attn.o_proj.weight.shape[1] == text.num_attention_heads // 2 * head_dim
    # Rank 1 holds the second half of the heads and of the MLP's features.
    full_q, full_down = whole.self_attn.q_proj.weight, whole.mlp.down_proj.weight
    torch.testing.assert_close(layer.self_attn.q_proj.weight, full_q[full_q.shape[0] // 2 :])
    torch.testing.assert_close(layer.mlp.down_proj.weight, full_down[:, full_down.shape[1] // 2 :])
    # The embedding, lm_head and any vision tower stay whole.
    assert net.get_input_embeddings().weight.shape == model.get_input_embeddings().weight.shape
    assert net.lm_head.weight.shape == model.lm_head.weight.shape
    if hasattr(model.model, "visual"):
        for (name, a), b in zip(
            model.model.visual.named_parameters(), net.model.visual.parameters()
        ):
            assert a.shape == b.shape, name


def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_qwen3_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_qwen3_path)  # 4 heads, 2 KV heads
    check_tensor_parallel_size(config, 2)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"
    ):
        check_tensor_parallel_size(config, 3)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=4 does not divide the model's num_key_value_heads=2"
    ):
        check_tensor_parallel_size(config, 4)


class ThreadGroup:
    """The slice of TensorParallelGroup a ModelRunner uses, for ranks that are threads."""

    def __init__(
        self, rank: int, world_size: int, reduce: ThreadAllReduce, values: list[int | None]
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._reduce, self._values = reduce, values

    def shard(self, net) -> int:
        return shard_model(net, self.rank, self.world_size, self._reduce.for_rank(self.rank))

    def min_over_ranks(self, value: int) -> int:
        self._values[self.rank] = value
        self._reduce.barrier.wait()
        return min(self._values)


def test_kv_cache_holds_this_ranks_kv_heads_and_the_blocks_every_rank_can_hold(tiny_qwen3_path):
    """Ranks whose memory differs (as free GPU memory does) agree on the
    smallest block count: a rank with more blocks than another would hand out
    block ids the other cannot hold."""
    from tokenbudget.core.config import CacheConfig, SchedulerConfig
    from tokenbudget.worker.attention import kv_cache_bytes_per_block
    from tokenbudget.worker.model_runner import ModelRunner

    per_block = kv_cache_bytes_per_block(2, 4, 1, 16, torch.float32)  # 1 of 2 KV heads
    memory = [40 * per_block, 25 * per_block]
    reduce, values = ThreadAllReduce(2), [None, None]
    runners, blocks = [None, None], [None, None]

    def run(rank: int) -> None:
        runners[rank] = ModelRunner(
            tiny_qwen3_path,
            dtype="float32",
            device="cpu",
            parallel=ThreadGroup(rank, 2, reduce, values),
        )
        blocks[rank] = runners[rank].initialize_kv_cache(
            CacheConfig(block_size=4, kv_cache_memory_bytes=memory[rank]),
            SchedulerConfig(max_model_len=64),
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert blocks == [25, 25]
    assert values == [40, 25]  # each rank's own budget, in blocks of its own KV heads
    for runner in runners:  # [K/V, blocks, block size, this rank's KV heads, head_dim]
        assert [tuple(kv.shape) for kv in runner.kv_caches] == [(2, 25, 4, 1, 16)] * 2
