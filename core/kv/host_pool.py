"""The host-memory tier's slots: the bookkeeping twin of the device BlockPool.

Slots 0..num_slots-1 (no null slot: host slots never appear in a block
table). A slot holds the KV of one block; the worker owns the tensors
(worker/kv_transfer.py) and copies what the scheduler lists. A slot is
referenced while a swapped-out request owns it or while a copy reads it this
step; an unreferenced slot with a hash stays findable (the second-tier prefix
cache) until it is reused, least recently used first. Free slots without a
hash sit at the head of the queue, as in the device pool.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from tokenbudget.core.kv.block_pool import FreeBlockQueue, KVCacheBlock


class HostBlockPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_offload_blocks must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.slots = [KVCacheBlock(i) for i in range(num_slots)]
        self.free_queue = FreeBlockQueue(self.slots)
        self.cached: dict[bytes, KVCacheBlock] = {}
        # Told the hash of every slot that forgets it on reuse (KV events).
        self.on_evict: Callable[[bytes], None] | None = None

    def get_num_free(self) -> int:
        """Slots that can be taken now (empty, or cached and unreferenced)."""
        return self.free_queue.num_free

    def num_used(self) -> int:
        """Slots holding KV: referenced or cached."""
        return sum(1 for s in self.slots if s.ref_cnt > 0 or s.block_hash is not None)

    def get_slots(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot get {n} host slots, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            slot = self.free_queue.popleft()
            if slot.block_hash is not None:
                self._forget(slot)
            slot.ref_cnt = 1
            out.append(slot)
        return out

    def touch(self, slots: Iterable[KVCacheBlock]) -> None:
        for slot in slots:
            if slot.ref_cnt == 0:
                self.free_queue.remove(slot)
            slot.ref_cnt += 1

    def free(self, slots: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; see BlockPool.free_blocks for the order."""
        queue = self.free_queue
        for slot in slots:
            slot.ref_cnt -= 1
            if slot.ref_cnt == 0:
                if slot.block_hash is None:
                    queue.appendleft(slot)
                else:
                    queue.append(slot)

    def cache(self, slot: KVCacheBlock, block_hash: bytes) -> bool:
        """Make ``slot`` findable by ``block_hash``; False when another slot
        already holds that hash (one slot per hash)."""
        if block_hash in self.cached or slot.block_hash is not None:
            return False
        slot.block_hash = block_hash
        self.cached[block_hash] = slot
        return True

    def _forget(self, slot: KVCacheBlock) -> None:
        h = slot.block_hash
        if self.cached.get(h) is slot:
            del self.cached[h]
            if self.on_evict is not None:
                self.on_evict(h)
        slot.block_hash = None

    def reset(self) -> bool:
        """Forget every hash; refused (False) while a slot is referenced."""
        if self.free_queue.num_free != self.num_slots:
            return False
        for slot in self.slots:
            slot.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "host free count out of sync"
        free_ids = {s.block_id for s in free}
        assert len(free_ids) == len(free), "a host slot is in the free queue twice"
        for slot in self.slots:
            assert slot.ref_cnt >= 0, f"host {slot} has a negative ref count"
            assert (slot.ref_cnt == 0) == (slot.block_id in free_ids), \
                f"host {slot}: free iff unreferenced"
        for h, slot in self.cached.items():
            assert slot.block_hash == h, f"host {slot} cached under a stale hash"
        for slot in self.slots:
            if slot.block_hash is not None:
                assert self.cached.get(slot.block_hash) is slot, \
                    f"host {slot} has a hash nobody can find"
