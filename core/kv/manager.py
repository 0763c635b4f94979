"""Per-request block tables on top of the block pool: prefix-cache lookup,
all-or-nothing slot allocation, caching of newly full blocks, freeing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenbudget.core.kv.block_pool import BlockPool, KVCacheBlock
from tokenbudget.core.kv.hashing import BlockHasher

if TYPE_CHECKING:
    from tokenbudget.core.request import Request

# Told of a block newly findable by its hash: (hash, parent hash, token ids),
# and with KV cache groups (core/kv/groups.py) the block's group.
OnStore = Callable[..., None]


class KVCacheManager:
    # The window of each KV cache group: one full-attention group here
    # (HybridKVCacheManager, core/kv/groups.py, has several).
    windows: tuple[int, ...] = (0,)

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: int | None = None,
        *,
        on_evict: Callable[[KVCacheBlock], None] | None = None,
        on_store: OnStore | None = None,
    ) -> None:
        """``on_evict`` and ``on_store`` tell the host tier and the KV events
        (core/kv/tiering.py) of blocks leaving and joining the prefix cache."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict=on_evict)
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.on_store = on_store

    # -- lookup -----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request`` in whole blocks."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        hashes = self.hasher.update(request)
        # At most num_tokens - 1 tokens can be cache hits: the last prompt token
        # must be recomputed to produce the logits of the first output token.
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        hits: list[KVCacheBlock] = []
        get = self.block_pool.cached.get
        for h in hashes[:max_blocks]:
            block = get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counted once per admission, not per lookup: a request blocked at the
        head of the queue is looked up every step. Nothing is looked up (or
        counted) with caching off, or for a request that skips the cache."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens

    def num_cached_prefix_blocks(self, request: Request) -> int:
        """Leading blocks of ``request`` found in the cache, without touching
        the hit statistics (used by cache-aware policies)."""
        if not self.enable_caching:
            return 0
        n = 0
        get = self.block_pool.cached.get
        for h in self.hasher.update(request):
            if get(h) is None:
                break
            n += 1
        return n

    # -- allocation --------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones
        (plus prefix hits and lookahead slots). All or nothing: returns the new
        block ids, or None when the pool is short and nothing changed."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = []
        elif not new_computed_blocks:
            # Fast path (most decode steps): the last block has room and no
            # block becomes full.
            end = request.num_computed_tokens + num_new_tokens
            bs = self.block_size
            if end + num_lookahead_tokens <= len(blocks) * bs:
                known = len(request.all_token_ids)
                if (end if end < known else known) // bs <= self.num_cached_blocks[req_id]:
                    return []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens + num_lookahead_tokens
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        need = -(-total // self.block_size) - len(blocks) - num_hits
        pool = self.block_pool
        if need > 0 or num_hits:
            # Hit blocks sitting in the free queue stop being free once touched.
            revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if num_hits else 0
            if max(need, 0) + revived > pool.free_queue.num_free:
                return None
        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = blocks
            self.num_cached_blocks[req_id] = 0
        if num_hits:
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[req_id] = len(blocks)
        new_blocks = pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Only tokens whose ids are known can be hashed: not drafts, not
            # async placeholders.
            self._cache_full_blocks(
                request, blocks, min(num_computed + num_new_tokens, request.num_tokens)
            )
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        num_full = num_tokens // self.block_size
        req_id = request.request_id
        start = self.num_cached_blocks[req_id]
        if num_full <= start:
            return
        hashes = self.hasher.update(request)
        cache = self.block_pool.cache_block
        on_store = self.on_store
        for i in range(start, num_full):
            if cache(blocks[i], hashes[i]) and on_store is not None:
                bs = self.block_size
                on_store(
                    hashes[i],
                    hashes[i - 1] if i else None,
                    request.all_token_ids[i * bs : (i + 1) * bs],
                )
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            # Tail first: the end of a chain is evicted before its head, so a
            # shared prefix outlives the suffixes hanging off it.
            self.block_pool.free_blocks(reversed(blocks))

    # -- queries -----------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def group_tables(self, request_id: str) -> list[list[KVCacheBlock]]:
        """The request's block table of each KV cache group (one here; see core/kv/groups.py)."""
        blocks = self.req_to_blocks.get(request_id)
        return [blocks] if blocks is not None else []

    def get_num_common_prefix_blocks(self, request: Request, num_running: int) -> int:
        """Leading blocks shared by all ``num_running`` running requests (for
        cascade attention): blocks referenced exactly once per running request."""
        n = 0
        for block in self.req_to_blocks.get(request.request_id, ()):
            if block.ref_cnt != num_running:
                break
            n += 1
        return n

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def blocks_in_use_per_group(self) -> list[int]:
        """Blocks the requests hold in each KV cache group (``windows``), a
        block shared by several requests once. A block is in one group only,
        so these sum to the pool's blocks in use."""
        null = self.block_pool.null_block
        used: list[set[int]] = [set() for _ in self.windows]
        for rid in self.req_to_blocks:
            for seen, table in zip(used, self.group_tables(rid)):
                seen.update(b.block_id for b in table if b is not null)
        return [len(seen) for seen in used]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # used by the scheduler
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free or evictable)."""
        return self.block_pool.get_num_free_blocks()

    # used by the scheduler
    def num_reclaimable_blocks(self, request_id: str) -> int:
        """Blocks that freeing the request would give back: those no one
        else references."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b.ref_cnt == 1)
