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
from tokenbudget.core.kv.groups import HybridKVCacheManager
from tokenbudget.core.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from tokenbudget.core.config import CacheConfig
    from tokenbudget.core.outputs import SchedulerOutput
    from tokenbudget.core.request import Request


@dataclass(slots=True)
class SwappedKV:
    """Host slots holding a preempted request's first ``num_tokens`` tokens of KV."""

    slots: list[KVCacheBlock]
    num_tokens: int


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
        if self.host is not None and isinstance(kv, HybridKVCacheManager):
            raise ValueError(
                "the host KV tier (kv_offload_memory / num_offload_blocks) does not support "
                "models with several KV cache groups (sliding-window layers) yet"
            )
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
        blocks = self.kv.req_to_blocks.get(rid, ())
        for group, table in enumerate(self.kv.group_tables(rid)):
            self._uncache_uncomputed(table, computed, group)
        if computed <= 0:
            return
        self._computed_before[rid] = computed
        # A request that must compute its whole prompt (prompt logprobs, MEAN
        # or CLS pooling) recomputes it: a swap would skip those positions.
        if self.host is not None and not req.skip_reading_prefix_cache:
            self._swap_out_request(req, blocks, computed)

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

    def _swap_out_request(self, req: Request, blocks, computed: int) -> None:
        host = self.host
        bs = self.block_size
        n = -(-computed // bs)
        num_full = computed // bs
        hashes = req.block_hashes if self.kv.enable_caching else ()
        plan: list[KVCacheBlock | None] = []
        for i in range(n):
            h = hashes[i] if i < num_full and i < len(hashes) else None
            plan.append(host.cached.get(h) if h is not None else None)
        shared = [s for s in plan if s is not None]
        need = len(plan) - len(shared)
        if need + sum(1 for s in shared if s.ref_cnt == 0) > host.get_num_free_blocks():
            return  # no room: recompute on resume
        host.touch(shared)
        fresh = iter(host.get_new_blocks(need))
        slots = []
        for i, slot in enumerate(plan):
            if slot is None:
                slot = next(fresh)
                self._swap_out.append((blocks[i].block_id, slot.block_id))
                h = hashes[i] if i < num_full and i < len(hashes) else None
                if h is not None and host.cache_block(slot, h) and self.events is not None:
                    self.events.stored(h, HOST)
            slots.append(slot)
        self.num_swapped_out_blocks += need
        self.swapped[req.request_id] = SwappedKV(slots, computed)

    def _on_device_evict(
        self, block: KVCacheBlock, block_hash: bytes | None = None, group: int = 0
    ) -> None:
        """Spill a cached device block to the host before it is reused. With
        KV cache groups (no host tier) its hash and group come along."""
        h = block_hash or block.block_hash
        host = self.host
        if host is not None:
            slot = host.cached.get(h)
            if slot is not None:
                if slot.ref_cnt == 0:  # most recently used again
                    host.free_queue.remove(slot)
                    host.free_queue.append(slot)
            elif host.get_num_free_blocks():
                (slot,) = host.get_new_blocks(1)
                host.cache_block(slot, h)
                host.free_blocks([slot])
                self._swap_out.append((block.block_id, slot.block_id))
                self.num_swapped_out_blocks += 1
                if self.events is not None:
                    self.events.stored(h, HOST)
        if self.events is not None:
            self.events.removed(h, DEVICE, group)

    def _on_device_store(
        self, block_hash: bytes, parent_hash: bytes | None, token_ids: list[int], group: int = 0
    ) -> None:
        self.events.stored(block_hash, DEVICE, parent_hash, token_ids, group)

    def _on_host_evict(self, slot: KVCacheBlock) -> None:
        self.events.removed(slot.block_hash, HOST)

    # -- admission -----------------------------------------------------------------
    def plan_load(
        self, req: Request, hits: list[KVCacheBlock], num_cached: int
    ) -> tuple[list[KVCacheBlock], int] | None:
        """The host slots to load after the device ``hits`` and the tokens then
        computed; None when a swapped request must wait for the load budget.
        The slots are pinned at once (allocating the request's device blocks
        may spill evicted blocks to the host, which must not reuse them):
        follow with ``commit_load``, or ``cancel_load`` if allocation fails."""
        host = self.host
        if host is None:
            return [], num_cached
        bs = self.block_size
        record = self.swapped.get(req.request_id)
        if record is not None:
            # The last token is always computed again: it yields the logits.
            total = min(record.num_tokens, req.num_tokens - 1)
            if len(hits) * bs >= total:
                return [], num_cached
            slots = record.slots[len(hits) : -(-total // bs)]
            if self._loaded and self._loaded + len(slots) > self.load_budget:
                return None
            self._pin(slots)
            return slots, total
        if not host.cached or not self.kv.enable_caching or req.skip_reading_prefix_cache:
            return [], num_cached
        hashes = req.block_hashes
        max_blocks = min(len(hashes), (req.num_tokens - 1) // bs)
        room = self.load_budget - self._loaded if self._loaded else max_blocks
        slots = []
        get = host.cached.get
        for h in hashes[len(hits) : max_blocks]:
            slot = get(h)
            if slot is None or len(slots) >= room:
                break
            slots.append(slot)
        self._pin(slots)
        return slots, num_cached + len(slots) * bs

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
        self, req: Request, hits: list[KVCacheBlock], slots: list[KVCacheBlock], num_cached: int
    ) -> None:
        """``req`` was admitted with ``num_cached`` tokens computed, ``slots``
        loading into the device blocks right after its ``hits``."""
        rid = req.request_id
        before = self._computed_before.pop(rid, None)
        if before is not None and before > num_cached:
            self.num_recomputed_tokens += before - num_cached
        host = self.host
        if slots:
            blocks = self.kv.req_to_blocks[rid]
            start = len(hits)
            self._swap_in.extend(
                (s.block_id, blocks[start + j].block_id) for j, s in enumerate(slots)
            )
            self._loaded += len(slots)
            self.num_swapped_in_blocks += len(slots)
            if rid not in self.swapped:
                self.num_host_hit_tokens += len(slots) * self.block_size
        record = self.swapped.pop(rid, None)
        if record is not None:
            host.free_blocks(record.slots)

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
