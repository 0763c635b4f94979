"""The host-memory KV tier, worker side: the host tensors and the copies the
scheduler lists in each SchedulerOutput (core/kv/tiering.py decides them).

One tensor ``[num_tensors, 2, num_slots, block_size, num_kv_heads, head_dim]``
in host memory, one row per distinct KV tensor: with KV cache groups
(worker/kv_groups.py) layer i of each group shares a tensor, and a block id
names memory in one group, so a block's copy through every distinct tensor
carries exactly what its group's layers wrote (``num_tensors`` is the layers
of the largest group: a slot costs the bytes of a device block). It is
pinned on CUDA, so device copies can be asynchronous. Every copy is issued
on the device's current stream, the one the forward runs on: swap-outs,
then swap-ins, then the forward, in stream order.
"""

from __future__ import annotations

import torch

from tokenbudget.core.config import CacheConfig


def num_offload_slots(cache_config: CacheConfig, bytes_per_block: int) -> int:
    """Host slots to allocate: ``num_offload_blocks`` if given, else as many
    blocks as ``kv_offload_memory_bytes`` holds (0: no host tier)."""
    if cache_config.num_offload_blocks is not None:
        return cache_config.num_offload_blocks
    if cache_config.kv_offload_memory_bytes:
        n = cache_config.kv_offload_memory_bytes // bytes_per_block
        if n < 1:
            raise ValueError(
                f"kv_offload_memory={cache_config.kv_offload_memory_bytes} bytes "
                f"holds no KV block of {bytes_per_block} bytes; raise it or "
                "leave it unset"
            )
        return n
    return 0


class HostKVCache:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(
                f"the host KV tier needs at least one block, got {num_slots}; "
                "raise kv_offload_memory"
            )
        # Layers sharing a tensor (KV cache groups) are copied once.
        kv_caches = list({id(t): t for t in kv_caches}.values())
        self.kv_caches = kv_caches
        _, _, block_size, num_kv_heads, head_dim = kv_caches[0].shape
        device = kv_caches[0].device
        self.device = device
        self.tensor = torch.zeros(
            len(kv_caches),
            2,
            num_slots,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=kv_caches[0].dtype,
            pin_memory=device.type == "cuda",
        )

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[2]

    def copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Run one step's copies: every (device block -> host slot), then every
        (host slot -> device block)."""
        if swap_out:
            blocks, slots = zip(*swap_out)
            src = torch.tensor(blocks, device=self.device)
            data = torch.stack([cache.index_select(1, src) for cache in self.kv_caches])
            # A device -> host copy waits for the forwards before it (same stream).
            self.tensor.index_copy_(2, torch.tensor(slots), data.to("cpu"))
        if swap_in:
            slots, blocks = zip(*swap_in)
            data = self.tensor.index_select(2, torch.tensor(slots))
            if self.device.type == "cuda":
                data = data.pin_memory().to(self.device, non_blocking=True)
            dst = torch.tensor(blocks, device=self.device)
            for layer, cache in enumerate(self.kv_caches):
                cache.index_copy_(1, dst, data[layer])
