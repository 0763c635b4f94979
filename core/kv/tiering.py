"""The host-memory KV tier, scheduler side: swap on preemption, the second
tier of the prefix cache, and the copies the worker runs for both.

* A preempted request's computed blocks are copied to host slots (a block
  whose hash the host already holds is shared, not copied) and it waits as
  *swapped*; on resume they are copied back into fresh device blocks, so
  nothing is recomputed. When the host tier lacks room, preemption falls back
  to recompute.
* A cached device block evicted for reuse is copied to the host first
  (spill). A prefix lookup continues, past the device hits, through the host
  tier's hashes; host hits are loaded into fresh device blocks.
* At most ``kv_load_blocks_per_step`` blocks are loaded per step (one request
  needing more loads alone in its step); a swapped request that does not fit
  waits for the next step, a prefix hit is cut short and the rest computed.
* With KV cache groups (core/kv/groups.py) every group's blocks are swapped
  (not the null blocks a window left behind) and host slots are keyed as the
  device keys them (group g > 0: the hash with g appended); a load serves the
  longest prefix every group can, by the device's hit rule
  (core/kv/group_loads.py). A block id names memory in one group, and the
  worker copies a block across every KV tensor (worker/kv_transfer.py).

Copies travel in the SchedulerOutput: ``kv_swap_out`` (device block, host
slot) and ``kv_swap_in`` (host slot, device block). The worker runs every
swap-out, then every swap-in, then the step's forward. That order is safe:

* a device block freed this step (preempted or evicted) may be written this
  step by a swap-in or the forward: its swap-out reads it first;
* a host slot a swap-in reads this step stays referenced until the step's
  output is built, so no swap-out of the same step reuses it;
* a block copied out holds KV computed by an earlier step (steps run in
  order on the worker, async scheduling included): blocks a preempted request
  would have computed this step lose their hash (``_uncache_uncomputed``) and
  a swap covers only the tokens computed before this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenbudget.core.kv.block_pool import BlockPool, KVCacheBlock
from tokenbudget.core.kv.events import DEVICE, HOST, KVEventPublisher
from tokenbudget.core.kv.group_loads import (
    HostLoad,
    group_key,
    num_skipped,
    prefix_copies,
    release_unloaded,
    swapped_copies,
)
from tokenbudget.core.kv.groups import HybridKVCacheManager
from tokenbudget.core.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from tokenbudget.core.config import CacheConfig
    from tokenbudget.core.outputs import SchedulerOutput
    from tokenbudget.core.request import Request


@dataclass(slots=True)
class SwappedKV:
    """Host slots holding a preempted request's first ``num_tokens`` tokens of
    KV: ``slots`` every slot it holds, ``tables`` each KV cache group's slot
    per block (None: the window had left the block, nothing stored)."""

    slots: list[KVCacheBlock]
    num_tokens: int
    tables: list[list[KVCacheBlock | None]]


def make_kv_cache_manager(cache_config: CacheConfig, **callbacks) -> KVCacheManager:
    """One table per request, or one per KV cache group when the model's layers
    attend differently (``cache_config.kv_group_windows``, core/kv/groups.py)."""
    args = (cache_config.enable_prefix_caching, cache_config.hash_algo, cache_config.hash_seed)
    windows = tuple(cache_config.kv_group_windows)
    if windows in ((), (0,)):
        return KVCacheManager(cache_config.num_blocks, cache_config.block_size, *args, **callbacks)
    names = ("enable_caching", "hash_algo", "hash_seed")
    return HybridKVCacheManager(
        cache_config.num_blocks,
        cache_config.block_size,
        windows,
        **dict(zip(names, args)),
        **callbacks,
    )


class KVTiering:
    """Builds the device tier (``kv``, a KVCacheManager) and the host tier
    (``host``, a BlockPool of slots, None when off), each told at
    construction whom to call when a block leaves or joins its cache."""

    def __init__(self, cache_config: CacheConfig) -> None:
        events = KVEventPublisher() if cache_config.enable_kv_cache_events else None
        self.events = events
        n = cache_config.num_offload_blocks or 0
        # A host slot holds the KV of one block. It is referenced while a
        # swapped-out request owns it or while a copy reads it this step; an
        # unreferenced slot with a hash stays findable (the second tier of the
        # prefix cache) until it is reused, least recently used first.
        self.host = (
            BlockPool(
                n,
                reserve_null_block=False,
                on_evict=self._on_host_evict if events is not None else None,
            )
            if n
            else None
        )
        spill = self.host is not None or events is not None
        self.kv = kv = make_kv_cache_manager(
            cache_config,
            on_evict=self._on_device_evict if spill else None,
            on_store=self._on_device_store if events is not None else None,
        )
        # Group g > 0 keys its blocks by the hash with g appended, one byte longer.
        self._hash_size = len(kv.hasher._hash(b""))
        self.block_size = kv.block_size
        self.load_budget = cache_config.kv_load_blocks_per_step
        self.swapped: dict[str, SwappedKV] = {}
        # This step's copies, and the host slots its swap-ins read.
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._pinned: list[KVCacheBlock] = []
        self._loaded = 0
        # Preempted request -> tokens it had computed, to count recomputation.
        self._computed_before: dict[str, int] = {}
        self.num_recomputed_tokens = 0
        self.num_swapped_out_blocks = 0  # copies device -> host (swaps and spills)
        self.num_swapped_in_blocks = 0  # copies host -> device
        self.num_host_hit_tokens = 0  # prefix tokens loaded from the host tier

    def take_over_events(self, old: KVTiering) -> None:
        """Publish on ``old``'s publisher, so its subscribers stay (a fresh
        scheduler after the workers came back). They see AllCleared: the
        blocks the old scheduler knew went with the old workers' KV."""
        if old.events is None or self.events is None:
            return
        # The callbacks given at construction publish on self.events.
        self.events = old.events
        self.events.flush()
        self.events.cleared()
        self.events.flush()

    # -- preemption ----------------------------------------------------------------
    def on_preempt(self, req: Request) -> None:
        """Call before ``req``'s blocks are freed, while ``num_computed_tokens``
        still counts what steps before this one computed."""
        rid = req.request_id
        computed = req.num_computed_tokens
        for group, table in enumerate(self.kv.group_tables(rid)):
            self._uncache_uncomputed(table, computed, group)
        if computed <= 0:
            return
        self._computed_before[rid] = computed
        # A request that must compute its whole prompt (prompt logprobs, MEAN
        # or CLS pooling) recomputes it: a swap would skip those positions.
        if self.host is not None and not req.skip_reading_prefix_cache:
            self._swap_out_request(req, computed)

    def _uncache_uncomputed(self, blocks, computed: int, group: int) -> None:
        # Blocks this step filled at scheduling time are hashed already, but a
        # victim's step is taken back: their KV will never be computed.
        pool = self.kv.block_pool
        for block in blocks[computed // self.block_size :]:
            h = block.block_hash
            if h is not None and block.ref_cnt == 1 and pool.cached.get(h) is block:
                pool.uncache(block)
                if self.events is not None:
                    # Group g > 0 caches under the hash with g appended (groups.py).
                    self.events.removed(h[:-1] if group else h, DEVICE, group)

    def _swap_out_request(self, req: Request, computed: int) -> None:
        host, kv = self.host, self.kv
        bs = self.block_size
        n = -(-computed // bs)
        num_full = computed // bs
        hashes = req.block_hashes if kv.enable_caching else ()
        null = kv.block_pool.null_block
        # The swap-in restores at most num_tokens - 1 tokens: blocks out of
        # every such query's window are not stored.
        reach = min(computed, req.num_tokens - 1)
        # (group, index, device block, hash or None, host slot already holding it)
        plan = []
        for g, table in enumerate(kv.group_tables(req.request_id)):
            for i in range(num_skipped(kv, reach, kv.windows[g]), n):
                if table[i] is null:
                    continue
                h = hashes[i] if i < num_full and i < len(hashes) else None
                key = group_key(kv, h, g) if h is not None else None
                plan.append((g, i, table[i], h, host.cached.get(key) if key else None))
        shared = [p[4] for p in plan if p[4] is not None]
        need = len(plan) - len(shared)
        if need + sum(1 for s in shared if s.ref_cnt == 0) > host.get_num_free_blocks():
            return  # no room: recompute on resume
        host.touch(shared)
        fresh = iter(host.get_new_blocks(need))
        tables: list[list[KVCacheBlock | None]] = [[None] * n for _ in kv.windows]
        slots = []
        for g, i, block, h, slot in plan:
            if slot is None:
                slot = next(fresh)
                self._swap_out.append((block.block_id, slot.block_id))
                if h is not None and host.cache_block(slot, group_key(kv, h, g)):
                    if self.events is not None:
                        self.events.stored(h, HOST, group=g)
            tables[g][i] = slot
            slots.append(slot)
        self.num_swapped_out_blocks += need
        self.swapped[req.request_id] = SwappedKV(slots, computed, tables)

    def _split(self, key: bytes) -> tuple[bytes, int]:
        """A cache key's block hash and KV cache group."""
        size = self._hash_size
        return (key, 0) if len(key) == size else (key[:size], key[size])

    def _on_device_evict(
        self, block: KVCacheBlock, block_hash: bytes | None = None, group: int = 0
    ) -> None:
        """Spill a cached device block to the host before it is reused. With
        KV cache groups its hash and group come along; the host keys it as
        the device did (``block.block_hash``)."""
        h = block_hash or block.block_hash
        key = block.block_hash
        host = self.host
        if host is not None:
            slot = host.cached.get(key)
            if slot is not None:
                if slot.ref_cnt == 0:  # most recently used again
                    host.free_queue.remove(slot)
                    host.free_queue.append(slot)
            elif host.get_num_free_blocks():
                (slot,) = host.get_new_blocks(1)
                host.cache_block(slot, key)
                host.free_blocks([slot])
                self._swap_out.append((block.block_id, slot.block_id))
                self.num_swapped_out_blocks += 1
                if self.events is not None:
                    self.events.stored(h, HOST, group=group)
        if self.events is not None:
            self.events.removed(h, DEVICE, group)

    def _on_device_store(
        self, block_hash: bytes, parent_hash: bytes | None, token_ids: list[int], group: int = 0
    ) -> None:
        self.events.stored(block_hash, DEVICE, parent_hash, token_ids, group)

    def _on_host_evict(self, slot: KVCacheBlock) -> None:
        h, group = self._split(slot.block_hash)
        self.events.removed(h, HOST, group)

    # -- admission -----------------------------------------------------------------
    def plan_load(
        self, req: Request, hits: list[KVCacheBlock], num_cached: int
    ) -> tuple[HostLoad, int] | None:
        """The host slots to load after the device ``hits`` and the tokens then
        computed; None when a swapped request must wait for the load budget.
        The slots are pinned at once (allocating the request's device blocks
        may spill evicted blocks to the host, which must not reuse them):
        follow with ``commit_load``, or ``cancel_load`` if allocation fails."""
        host = self.host
        if host is None:
            return HostLoad(), num_cached
        bs = self.block_size
        record = self.swapped.get(req.request_id)
        if record is not None:
            # The last token is always computed again: it yields the logits.
            total = min(record.num_tokens, req.num_tokens - 1)
            if len(hits) * bs >= total:
                return HostLoad(), num_cached
            copies = swapped_copies(self.kv, record.tables, len(hits), total)
            if copies is None:
                return HostLoad(), num_cached  # a block left the window: recompute
            if self._loaded and self._loaded + len(copies) > self.load_budget:
                return None
            load = HostLoad(copies, total - num_cached)
            self._pin(load)
            return load, total
        if not host.cached or not self.kv.enable_caching or req.skip_reading_prefix_cache:
            return HostLoad(), num_cached
        hashes = req.block_hashes
        max_blocks = min(len(hashes), (req.num_tokens - 1) // bs)
        room = (
            self.load_budget - self._loaded if self._loaded else max_blocks * len(self.kv.windows)
        )
        k, copies = prefix_copies(self.kv, host, hashes, len(hits), max_blocks, room)
        load = HostLoad(copies, k * bs - num_cached if copies else 0)
        self._pin(load)
        return load, num_cached + load.num_tokens

    def _pin(self, slots: list[KVCacheBlock]) -> None:
        if slots:
            self.host.touch(slots)
            self._pinned.extend(slots)

    def cancel_load(self, slots: list[KVCacheBlock]) -> None:
        """The request planned with ``slots`` was not admitted."""
        if slots:
            del self._pinned[-len(slots) :]
            self.host.free_blocks(slots)

    def commit_load(
        self, req: Request, hits: list[KVCacheBlock], load: HostLoad, num_cached: int
    ) -> None:
        """``req`` was admitted with ``num_cached`` tokens computed, ``load``
        copying into its device blocks after its ``hits``."""
        rid = req.request_id
        before = self._computed_before.pop(rid, None)
        if before is not None and before > num_cached:
            self.num_recomputed_tokens += before - num_cached
        if load.num_tokens:
            tables = self.kv.group_tables(rid)
            self._swap_in.extend((s.block_id, tables[g][i].block_id) for g, i, s in load.copies)
            self._loaded += len(load)
            self.num_swapped_in_blocks += len(load)
            if rid not in self.swapped:
                self.num_host_hit_tokens += load.num_tokens
            # Blocks out of a window got no copy: they must not stay cached.
            release_unloaded(self.kv, rid, len(hits), num_cached, self._on_unloaded)
        record = self.swapped.pop(rid, None)
        if record is not None:
            self.host.free_blocks(record.slots)

    def _on_unloaded(self, block: KVCacheBlock, group: int) -> None:
        if self.events is not None:
            self.events.removed(self._split(block.block_hash)[0], DEVICE, group)

    def on_free(self, req: Request) -> None:
        """``req`` finished or was aborted (its swapped KV is not needed)."""
        rid = req.request_id
        self._computed_before.pop(rid, None)
        record = self.swapped.pop(rid, None)
        if record is not None:
            self.host.free_blocks(record.slots)

    # -- step ------------------------------------------------------------------------
    def finish_step(self, out: SchedulerOutput) -> None:
        """Hand this step's copies to ``out``; publish its events."""
        if self._swap_out:
            pairs = self._swap_out
            # A slot spilled to twice this step keeps the last block.
            last = {slot: block for block, slot in pairs}
            out.kv_swap_out = (
                pairs
                if len(last) == len(pairs)
                else [(block, slot) for slot, block in last.items()]
            )
            self._swap_out = []
        if self._swap_in:
            out.kv_swap_in, self._swap_in = self._swap_in, []
        if self._pinned:
            self.host.free_blocks(self._pinned)
            self._pinned = []
        self._loaded = 0
        if self.events is not None:
            self.events.flush()

    def reset(self) -> bool:
        """Forget every cached hash in both tiers; refused while any block or
        slot is in use (a request runs or is swapped)."""
        host = self.host
        if host is not None and host.get_num_free_blocks() != host.num_usable:
            return False
        if not self.kv.reset_prefix_cache():
            return False
        if host is not None:
            host.reset_prefix_cache()
        if self.events is not None:
            self.events.flush()
            self.events.cleared()
            self.events.flush()
        return True

    def num_offload_blocks_used(self) -> int:
        return self.host.num_used() if self.host is not None else 0

    def check_invariants(self) -> None:
        """Between steps: every host reference is a swapped request's."""
        assert not self._pinned and not self._swap_out and not self._swap_in, (
            "copies left over from a step"
        )
        if self.host is None:
            assert not self.swapped, "swapped requests without a host tier"
            return
        self.host.check_invariants()
        refs: dict[int, int] = {}
        for record in self.swapped.values():
            for slot in record.slots:
                refs[slot.block_id] = refs.get(slot.block_id, 0) + 1
        for slot in self.host.blocks:
            assert slot.ref_cnt == refs.get(slot.block_id, 0), (
                f"host {slot}: {refs.get(slot.block_id, 0)} swapped requests hold it"
            )
