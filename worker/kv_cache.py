"""KV cache sizing: how many blocks a worker's cache gets.

In order: ``num_blocks`` when the configuration sets it; else the bytes of
``kv_cache_memory_bytes``; else, on a GPU, what a profile forward of a full
token budget leaves of ``total * gpu_memory_utilization``; else (CPU) what
every sequence at full length needs, at most 1 GiB. Tensor-parallel ranks
then agree on their minimum (ModelRunner.initialize_kv_cache).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from tokenbudget.worker.attention import allocate_kv_caches, build_metadata

if TYPE_CHECKING:
    from tokenbudget.core.config import CacheConfig, SchedulerConfig

# KV cache size on CPU when neither num_blocks nor kv_cache_memory_bytes is set.
_DEFAULT_CPU_KV_BYTES = 1 << 30


class ParallelGroup(Protocol):
    """What a model replica asks of its tensor-parallel group
    (worker/parallel/group.py:TensorParallelGroup)."""

    world_size: int

    def shard(self, net: torch.nn.Module) -> int: ...

    def min_over_ranks(self, value: int) -> int: ...


def blocks_per_request(scheduler_config: SchedulerConfig, block_size: int) -> int:
    """Blocks of one sequence at full length: max_model_len, its drafts and
    one more token."""
    return -(
        -(scheduler_config.max_model_len + scheduler_config.num_speculative_tokens + 1)
        // block_size
    )


def num_kv_blocks(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    per_block: int,
    device: torch.device,
    profile_free_memory: Callable[[], int],
    blocks_per_seq: int | None = None,
) -> int:
    """This rank's blocks (block 0 included) of ``per_block`` bytes each;
    ``profile_free_memory()`` gives the GPU bytes left for KV; ``blocks_per_seq``:
    the blocks of one sequence at full length (default: blocks_per_request;
    with KV cache groups, the sum over groups, worker/kv_groups.py)."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    if cache_config.kv_cache_memory_bytes is not None:
        budget = cache_config.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = profile_free_memory()
    else:
        # Never more than every sequence at full length needs.
        if blocks_per_seq is None:
            blocks_per_seq = blocks_per_request(scheduler_config, cache_config.block_size)
        need = scheduler_config.max_num_seqs * blocks_per_seq + 1
        budget = min(_DEFAULT_CPU_KV_BYTES, need * per_block)
    return budget // per_block


@torch.inference_mode()
def profile_free_memory(
    model: torch.nn.Module,
    attention_backend: str,
    kv_shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
) -> int:
    """GPU bytes left for KV after a forward of a full token budget through
    ``model`` (``kv_shape``: num_layers, num_kv_heads, head_dim)."""
    n = min(scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len)
    bs = cache_config.block_size
    num_blocks = -(-n // bs) + 1
    num_layers, num_kv_heads, head_dim = kv_shape
    caches = allocate_kv_caches(num_layers, num_blocks, bs, num_kv_heads, head_dim, dtype, device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    table = np.arange(1, num_blocks, dtype=np.int32)[None]
    pos = np.arange(n)
    meta = build_metadata(
        attention_backend,
        caches,
        bs,
        np.array([n]),
        np.array([n]),
        table,
        table[0, pos // bs].astype(np.int64) * bs + pos % bs,
        device,
    )
    ids = torch.zeros(1, n, dtype=torch.long, device=device)
    model(
        input_ids=ids,
        position_ids=torch.from_numpy(pos)[None].to(device),
        paged_attn=meta,
        use_cache=False,
        logits_to_keep=1,
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, meta
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    return max(int(total * cache_config.gpu_memory_utilization) - peak, 0)
