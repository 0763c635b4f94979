"""Which host slots a load copies into which device blocks, per KV cache group
(core/kv/tiering.py asks; core/kv/groups.py keeps the tables).

A load of the first ``k`` blocks of a request needs, as a device prefix hit
does, in a full-attention group every block ``0..k-1``; in a sliding-window
group only the blocks the next query reads (``[skip, k)``, ``skip`` the
leading blocks out of its window). Blocks before the device hits come from
the hits, the rest from host slots. A block allocated for a position no
group-``g`` query will read gets no copy: it holds no KV, so after allocation
it leaves the table (``release_unloaded``) before anything can hit on it.

With one group (``KVCacheManager``: windows ``(0,)``) every rule reduces to
the plain tier: a contiguous run of slots after the device hits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tokenbudget.core.kv.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from tokenbudget.core.kv.manager import KVCacheManager

# (group, block index in the request's table, host slot)
Copy = tuple[int, int, KVCacheBlock]


class HostLoad(list):
    """The host slots a load reads (what is pinned), with ``copies`` naming
    each one's group and block index, and ``num_tokens`` the tokens it adds."""

    __slots__ = ("copies", "num_tokens")

    def __init__(self, copies: Iterable[Copy] = (), num_tokens: int = 0) -> None:
        super().__init__(slot for _, _, slot in copies)
        self.copies = list(copies)
        self.num_tokens = num_tokens


def group_key(kv: KVCacheManager, block_hash: bytes, group: int) -> bytes:
    """The key group ``group`` caches a block under, in either tier."""
    return block_hash if group == 0 else kv._key(block_hash, group)


def num_skipped(kv: KVCacheManager, num_computed: int, window: int) -> int:
    """Leading blocks no query at position >= ``num_computed`` reads in a group."""
    return 0 if window == 0 else kv._num_skipped(num_computed, window)


def swapped_copies(
    kv: KVCacheManager, tables: list[list[KVCacheBlock | None]], num_hits: int, total: int
) -> list[Copy] | None:
    """The copies that restore a swapped request's first ``total`` tokens past
    ``num_hits`` device hits, from its per-group slot ``tables``; None when a
    needed block was not stored (it had left the window: recompute)."""
    bs = kv.block_size
    end = -(-total // bs)
    copies = []
    for g, window in enumerate(kv.windows):
        table = tables[g]
        for i in range(max(num_hits, num_skipped(kv, total, window)), end):
            slot = table[i] if i < len(table) else None
            if slot is None:
                return None
            copies.append((g, i, slot))
    return copies


def prefix_copies(
    kv: KVCacheManager, host: BlockPool, hashes, num_hits: int, max_blocks: int, room: int
) -> tuple[int, list[Copy]]:
    """The longest prefix of at most ``max_blocks`` blocks, past ``num_hits``
    device hits, that the host serves in every group with at most ``room``
    copies: (its blocks, the copies); ``(num_hits, [])`` when none is longer."""
    get = host.cached.get
    windows = kv.windows
    top = max_blocks
    for g, window in enumerate(windows):
        if window == 0:  # full attention: a contiguous run, one copy a block
            top = min(top, num_hits + room)
            j = num_hits
            while j < top and get(group_key(kv, hashes[j], g)) is not None:
                j += 1
            top = j
    for k in range(top, num_hits, -1):
        copies = []
        for g, window in enumerate(windows):
            for i in range(max(num_hits, num_skipped(kv, k * kv.block_size, window)), k):
                slot = get(group_key(kv, hashes[i], g))
                if slot is None or len(copies) >= room:
                    break
                copies.append((g, i, slot))
            else:
                continue
            break
        else:
            return k, copies
    return num_hits, []


def release_unloaded(
    kv: KVCacheManager,
    request_id: str,
    num_hits: int,
    num_computed: int,
    on_uncache: Callable[[KVCacheBlock, int], None],
) -> None:
    """After allocating a request that loaded up to ``num_computed`` tokens
    past ``num_hits`` device hits: blocks of sliding-window groups out of the
    window got no copy. Uncache them (``on_uncache(block, group)`` first: they
    were cached at allocation, holding no KV) and free every block the window
    left behind, the hits before them included."""
    windows = kv.windows
    if all(w == 0 for w in windows):
        return
    tables = kv.group_tables(request_id)
    pool = kv.block_pool
    for g, window in enumerate(windows):
        for block in tables[g][num_hits : num_skipped(kv, num_computed, window)]:
            if block.block_hash is not None and pool.cached.get(block.block_hash) is block:
                on_uncache(block, g)
                pool.uncache(block)
    kv._free_skipped(tables, num_computed)
