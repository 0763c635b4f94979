"""A fixed pool of KV blocks with ref counts and an LRU queue of free blocks:
one class for both tiers, the device's blocks and the host's slots.

A freed block keeps its hash and stays findable (a prefix-cache hit can
revive it) until it is popped from the free queue for reuse: eviction is lazy.
Freed blocks without a hash (a partial last block, or caching off) go to the
head of the queue, so they are reused before any cached block is evicted:
the queue is always the hash-less blocks, then the cached ones in LRU order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append to the
    tail and removal from the middle (when a cached free block is hit)."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free += 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """The device tier reserves block 0 as the null block (padding in block
    tables, never allocated and never freed): blocks 1..num_blocks-1 are
    usable. The host tier reserves none (``reserve_null_block=False``): its
    slots never appear in a block table, and the worker owns their tensors
    (worker/kv_transfer.py).

    ``on_evict`` is called with a cached block about to lose its hash for
    reuse: the device tier spills it to the host and reports it (KV events),
    the host tier reports it. See core/kv/tiering.py."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        *,
        reserve_null_block: bool = True,
        on_evict: Callable[[KVCacheBlock], None] | None = None,
    ) -> None:
        first = 1 if reserve_null_block else 0
        if num_blocks < first + 1:
            raise ValueError(f"num_blocks must be >= {first + 1}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_usable = num_blocks - first
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if reserve_null_block else None
        self.free_queue = FreeBlockQueue(self.blocks[first:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.on_evict = on_evict

    def get_num_free_blocks(self) -> int:
        """Blocks that can be taken now (empty, or cached and unreferenced)."""
        return self.free_queue.num_free

    def get_usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_usable

    def num_used(self) -> int:
        """Blocks holding KV: referenced or cached."""
        return sum(1 for b in self.blocks if b.ref_cnt > 0 or b.block_hash is not None)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot get {n} blocks, {self.free_queue.num_free} free")
        out = []
        popleft = self.free_queue.popleft
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; cached blocks reaching zero join the tail
        of the free queue in the given order (evicted first = first given),
        hash-less ones its head (reused first: they hold nothing to hit)."""
        queue = self.free_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Make ``block`` findable by its hash; False when it was not cached."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        # An equal block computed by another request in the same step stays
        # uncached: one block per hash keeps lookup and eviction simple.
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached.get(block.block_hash) is block:
            if self.on_evict is not None:
                self.on_evict(block)
            del self.cached[block.block_hash]
        block.block_hash = None

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget ``block``'s hash without evicting it (its KV is not computed)."""
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are in use,
        as a running request's blocks would otherwise lose their identity."""
        if self.free_queue.num_free != self.num_usable:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free count out of sync"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is in the free queue twice"
        usable = self.blocks[self.num_blocks - self.num_usable :]
        if self.null_block is not None:
            assert 0 not in free_ids, "the null block is in the free queue"
        for block in usable:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"{block}: free iff unreferenced"
            )
        referenced = sum(1 for b in usable if b.ref_cnt > 0)
        assert referenced + len(free) == self.num_usable, "blocks leaked"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"{block} cached under a stale hash"
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"{block} has a hash nobody can find"
                )
        first_cached = next((i for i, b in enumerate(free) if b.block_hash is not None), len(free))
        assert all(b.block_hash is not None for b in free[first_cached:]), (
            "a hash-less free block sits behind a cached one (it would evict a hit)"
        )
