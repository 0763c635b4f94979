"""KV cache groups: one block table per attention type, over one block pool.

A model whose layers attend differently (full attention, a sliding window of
W tokens, chunked local attention within chunks of C tokens as in Llama 4)
gets one *group* per kind: ``windows[g]`` is 0 for full attention, W > 0 for
a sliding window, ``-C`` for chunked local attention (``chunked(C)``: one int,
so the windows cross every boundary as before). A query at position p sees
the keys from ``first_visible(p, window)`` to p: 0, ``p - W + 1``, or its
chunk's start ``p // C * C``. Every group of a request has a table of the
same length, one entry per block of its tokens, so a block's index still says
which tokens it holds. A sliding or chunked group replaces blocks no future
query can see (every token of the block lies before ``first_visible`` of the
next computed position) with the null block 0 and frees them: a long request
holds ``O(W / block_size)`` (``O(C / block_size)``) blocks there.

The pool is shared: the worker gives layer ``i`` of each group the same KV
tensor (worker/kv_cache.py), so a block id names memory in exactly one group
and no group's capacity is reserved for it. Block ids reach the workers
interleaved (``SchedulerOutput``: block ``j`` of group ``g`` at ``j * G + g``),
so every message keeps one flat list per request and one group is today's
layout exactly.

A prefix-cache hit of ``k`` blocks needs, in a full group, blocks ``0..k-1``
cached; in a sliding or chunked group only the blocks the next query reads
(from ``first_visible(k * block_size)`` on: the last ``W - 1`` tokens, or the
chunk so far, none at a chunk's start). The request's hit is the longest
``k`` every group can serve. Groups share the block hashes of the
request; group ``g > 0`` finds its blocks under the hash with ``g`` appended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenbudget.core.kv.block_pool import KVCacheBlock
from tokenbudget.core.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from tokenbudget.core.request import Request

FULL = 0  # the window of a full-attention group


def chunked(chunk_size: int) -> int:
    """The window value of a chunked local attention group of ``chunk_size`` tokens."""
    if chunk_size < 1:
        raise ValueError(f"attention chunk size must be >= 1, got {chunk_size}")
    return -chunk_size


def first_visible(position: int, window: int) -> int:
    """The earliest key position a query at ``position`` sees in a group of ``window``."""
    if window > 0:
        return max(0, position - window + 1)
    if window < 0:
        return position // -window * -window
    return 0


def group_layers(layer_windows: list[int]) -> tuple[tuple[int, ...], list[int]]:
    """(window of each group, group of each layer) for layers with the given
    windows (0: full, -C: chunked): full attention first, then sliding windows
    in increasing order, then chunk sizes in increasing order."""
    windows = tuple(sorted(set(layer_windows), key=lambda w: (w < 0, abs(w))))
    index = {w: g for g, w in enumerate(windows)}
    return windows, [index[w] for w in layer_windows]


class GroupHits(list):
    """A prefix hit: the first group's hit blocks (what admission heuristics
    count), with every group's table of them in ``tables``."""

    __slots__ = ("tables",)

    def __init__(self, tables: list[list[KVCacheBlock]]) -> None:
        super().__init__(tables[0])
        self.tables = tables


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager with one table per group (``windows``, see above).
    Its host tier: core/kv/group_loads.py; KV events name each block's group."""

    def __init__(self, num_blocks: int, block_size: int, windows: tuple[int, ...], **kw) -> None:
        super().__init__(num_blocks, block_size, **kw)
        if not windows:
            raise ValueError("a hybrid KV cache needs at least one group window")
        self.windows = windows
        self.tables: dict[str, list[list[KVCacheBlock]]] = {}
        evict = self.block_pool.on_evict
        if evict is not None:
            # Told with the block's hash and group: a group g > 0 keys its
            # blocks by the hash with g appended (``_key``), one byte longer.
            size = len(self.hasher._hash(b""))

            def on_evict(block: KVCacheBlock) -> None:
                key = block.block_hash
                if len(key) == size:
                    evict(block, key, 0)
                else:
                    evict(block, key[:size], key[size])

            self.block_pool.on_evict = on_evict

    def _key(self, block_hash: bytes, group: int) -> bytes:
        return block_hash if group == 0 else block_hash + bytes((group,))

    # -- lookup -----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        hashes = self.hasher.update(request)
        k = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        get = self.block_pool.cached.get
        found = [[get(self._key(h, g)) for h in hashes[:k]] for g in range(len(self.windows))]
        # Each group's longest servable prefix no longer than k, until all agree.
        while True:
            k2 = min(self._servable(found[g], w, k) for g, w in enumerate(self.windows))
            if k2 == k:
                break
            k = k2
        null = self.block_pool.null_block
        tables = []
        for g, w in enumerate(self.windows):
            skip = self._num_skipped(k * self.block_size, w)
            tables.append([null] * skip + found[g][skip:k])
        return GroupHits(tables), k * self.block_size

    def _num_skipped(self, num_computed: int, window: int) -> int:
        """Leading blocks no query at position >= ``num_computed`` can see."""
        return first_visible(num_computed, window) // self.block_size

    def _servable(self, found: list, window: int, k: int) -> int:
        """The longest prefix of at most ``k`` blocks whose needed blocks are cached."""
        if window == FULL:
            return next((j for j, b in enumerate(found[:k]) if b is None), k)
        for j in range(k, 0, -1):
            skip = self._num_skipped(j * self.block_size, window)
            if all(b is not None for b in found[skip:j]):
                return j
        return 0

    def num_cached_prefix_blocks(self, request: Request) -> int:
        hits, _ = self.get_computed_blocks(request) if self.enable_caching else ([], 0)
        return len(hits)

    # -- allocation --------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """All or nothing over every group; the new block ids interleaved."""
        rid = request.request_id
        tables = self.tables.get(rid)
        if tables is not None:
            self._free_skipped(tables, request.num_computed_tokens)
        hit_tables = new_computed_blocks.tables if new_computed_blocks else None
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens + num_lookahead_tokens
        num_groups = len(self.windows)
        have = (len(tables[0]) if tables else 0) + (len(hit_tables[0]) if hit_tables else 0)
        per_group = max(-(-total // self.block_size) - have, 0)
        pool = self.block_pool
        null = pool.null_block
        revived = 0
        if hit_tables:
            revived = sum(1 for t in hit_tables for b in t if b.ref_cnt == 0 and b is not null)
        if per_group * num_groups + revived > pool.free_queue.num_free:
            return None
        if tables is None:
            tables = self.tables[rid] = [[] for _ in range(num_groups)]
            self.req_to_blocks[rid] = tables[0]
            self.num_cached_blocks[rid] = 0
        if hit_tables:
            for table, hits in zip(tables, hit_tables):
                pool.touch(b for b in hits if b is not null)
                table.extend(hits)
            self.num_cached_blocks[rid] = len(tables[0])
        new_blocks = pool.get_new_blocks(per_group * num_groups) if per_group else []
        for g, table in enumerate(tables):
            table.extend(new_blocks[g::num_groups])
        if self.enable_caching:
            self._cache_full_blocks(
                request, tables, min(num_computed + num_new_tokens, request.num_tokens)
            )
        return [b.block_id for b in new_blocks]

    def _free_skipped(self, tables: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Free (as cached blocks, oldest first) what the window left behind."""
        null = self.block_pool.null_block
        for table, window in zip(tables, self.windows):
            skip = self._num_skipped(num_computed, window)
            j = skip
            while j > 0 and table[j - 1] is not null:
                j -= 1
            if j < skip:
                self.block_pool.free_blocks(table[j:skip])
                table[j:skip] = [null] * (skip - j)

    def _cache_full_blocks(self, request: Request, tables, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        rid = request.request_id
        start = self.num_cached_blocks[rid]
        if num_full <= start:
            return
        hashes = self.hasher.update(request)
        cache = self.block_pool.cache_block
        null = self.block_pool.null_block
        bs = self.block_size
        for g, table in enumerate(tables):
            for i in range(start, num_full):
                block = table[i]
                if block is null:
                    continue  # left the window before its tokens were known
                stored = cache(block, self._key(hashes[i], g))
                if stored and self.on_store is not None:
                    parent = hashes[i - 1] if i else None
                    tokens = request.all_token_ids[i * bs : (i + 1) * bs]
                    self.on_store(hashes[i], parent, tokens, g)
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        tables = self.tables.pop(request.request_id, None)
        self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if tables:
            null = self.block_pool.null_block
            for table in tables:
                self.block_pool.free_blocks(b for b in reversed(table) if b is not null)

    # -- queries -----------------------------------------------------------
    def group_tables(self, request_id: str) -> list[list[KVCacheBlock]]:
        return self.tables.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        tables = self.tables.get(request_id)
        if not tables:
            return []
        return [b.block_id for row in zip(*tables) for b in row]

    def get_num_common_prefix_blocks(self, request: Request, num_running: int) -> int:
        return 0  # cascade attention reads one table; groups have several

    def num_reclaimable_blocks(self, request_id: str) -> int:
        null = self.block_pool.null_block
        return sum(
            1
            for table in self.tables.get(request_id, ())
            for b in table
            if b.ref_cnt == 1 and b is not null
        )

    def num_held_blocks(self, request_id: str, group: int) -> int:
        """Blocks (not the null block) the request holds in ``group``."""
        null = self.block_pool.null_block
        return sum(
            1 for b in self.tables.get(request_id, [[]] * (group + 1))[group] if b is not null
        )


def request_capacity_tokens(num_blocks: int, block_size: int, windows: tuple[int, ...]) -> int:
    """Tokens one request can surely hold alone in a pool of ``num_blocks``
    (block 0 included): each group may need a block per ``block_size`` tokens
    (a sliding-window group frees them only as the request advances, and a
    prefill chunk holds every block it writes)."""
    return (num_blocks - 1) // max(len(windows), 1) * block_size
