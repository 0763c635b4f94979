"""KV cache events: which block hashes each tier holds, as a stream.

The scheduler records events as they happen (engine thread) and publishes
them once per step as one ``KVEventBatch`` with the next sequence number.
Subscribers (in-process, or the gRPC ``SubscribeKvEvents`` stream) each have
a bounded buffer: a subscriber that falls behind has its buffer dropped and
gets a snapshot instead, so a slow reader never grows memory without bound.

Resync: a batch with ``snapshot=True`` starts with ``AllCleared`` and then
holds one ``BlockStored`` per block each tier holds, as of batch ``seq``; the
next batch is ``seq + 1``. Every subscription starts with one. A reader that
sees any other batch whose seq is not the last one + 1 has missed events:
its view is wrong until the next snapshot (``KVEventReplayer`` raises
``KVEventGap``), and it should subscribe again.

A model with several KV cache groups (core/kv/groups.py) caches a block hash
once per group: every event names its ``group`` (0, the first, for a model
with one), and a hash is held per (tier, group).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

DEVICE = "device"
HOST = "host"
TIERS = (DEVICE, HOST)


@dataclass(slots=True)
class BlockStored:
    block_hash: bytes
    parent_hash: bytes | None  # None for the first block of a sequence
    token_ids: list[int]
    tier: str
    group: int = 0  # the KV cache group (core/kv/groups.py)


@dataclass(slots=True)
class BlockRemoved:
    block_hash: bytes
    tier: str
    group: int = 0


@dataclass(slots=True)
class AllCleared:
    """Every tier forgot every block (reset_prefix_cache, or a snapshot's start)."""


KVEvent = BlockStored | BlockRemoved | AllCleared
Meta = tuple[bytes | None, list[int]]  # a block's parent hash and token ids


@dataclass(slots=True)
class KVEventBatch:
    seq: int
    events: list[KVEvent]
    snapshot: bool = False
    # Batches this subscriber lost before this snapshot (it fell behind).
    num_dropped: int = 0


class KVEventGap(RuntimeError):
    """A batch arrived out of sequence: events were lost."""


class KVEventSubscription:
    """One reader's bounded buffer; ``get`` from any thread."""

    def __init__(self, publisher: KVEventPublisher, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._publisher = publisher
        self._max_pending = max_pending
        self._queue: deque[KVEventBatch] = deque()
        self._cond = threading.Condition(publisher._lock)
        self._lagging = False
        self._dropped = 0
        self.closed = False

    def _put(self, batch: KVEventBatch) -> None:  # under the publisher's lock
        if self._lagging:
            self._dropped += 1
        elif len(self._queue) >= self._max_pending:
            self._dropped += len(self._queue) + 1
            self._queue.clear()
            self._lagging = True
        else:
            self._queue.append(batch)
        self._cond.notify_all()

    def get(self, timeout: float | None = None) -> KVEventBatch | None:
        """The next batch (a snapshot after falling behind), or None after
        ``timeout`` seconds or once closed."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._queue or self._lagging or self.closed, timeout
            ):
                return None
            if self.closed:
                return None
            if self._lagging:
                self._lagging = False
                dropped, self._dropped = self._dropped, 0
                return self._publisher._snapshot(dropped)
            return self._queue.popleft()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._publisher._subs.discard(self)
            self._cond.notify_all()


class KVEventPublisher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = []
        self._seq = 0
        self._subs: set[KVEventSubscription] = set()
        # As of batch _seq, under the lock: tier -> (hash, group) -> (parent, tokens).
        self._state: dict[str, dict[tuple[bytes, int], Meta]] = {t: {} for t in TIERS}
        # Engine thread only: parent and tokens of (hash, group)s some tier
        # holds or is about to (a block spilled to the host is stored without them).
        self._meta: dict[tuple[bytes, int], Meta] = {}

    # -- engine thread -----------------------------------------------------------
    def stored(
        self,
        block_hash: bytes,
        tier: str,
        parent_hash: bytes | None = None,
        token_ids: list[int] | None = None,
        group: int = 0,
    ) -> None:
        if token_ids is None:
            parent_hash, token_ids = self._meta[block_hash, group]
        else:
            self._meta[block_hash, group] = (parent_hash, token_ids)
        self._pending.append(BlockStored(block_hash, parent_hash, token_ids, tier, group))

    def removed(self, block_hash: bytes, tier: str, group: int = 0) -> None:
        self._pending.append(BlockRemoved(block_hash, tier, group))

    def cleared(self) -> None:
        self._pending.append(AllCleared())

    def flush(self) -> None:
        """Publish what was recorded since the last flush as one batch."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        with self._lock:
            self._seq += 1
            self._apply(events)
            batch = KVEventBatch(self._seq, events)
            for sub in self._subs:
                sub._put(batch)

    def _apply(self, events: list[KVEvent]) -> None:
        state = self._state
        for e in events:
            if type(e) is BlockStored:
                key = (e.block_hash, e.group)
                state[e.tier][key] = self._meta[key] = (e.parent_hash, e.token_ids)
            elif type(e) is BlockRemoved:
                key = (e.block_hash, e.group)
                state[e.tier].pop(key, None)
                # Forget the tokens of a hash no tier holds any more.
                if all(key not in t for t in state.values()):
                    self._meta.pop(key, None)
            else:
                for tier in state.values():
                    tier.clear()
                self._meta.clear()

    # -- any thread --------------------------------------------------------------
    def subscribe(self, max_pending: int = 1024) -> KVEventSubscription:
        """A new reader; its first batch is a snapshot of the current state."""
        sub = KVEventSubscription(self, max_pending)
        with self._lock:
            sub._queue.append(self._snapshot(0))
            self._subs.add(sub)
        return sub

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)

    def _snapshot(self, num_dropped: int) -> KVEventBatch:  # under the lock
        events: list[KVEvent] = [AllCleared()]
        for tier, blocks in self._state.items():
            events.extend(BlockStored(h, p, t, tier, g) for (h, g), (p, t) in blocks.items())
        return KVEventBatch(self._seq, events, snapshot=True, num_dropped=num_dropped)

    def cached_hashes(self, group: int = 0) -> dict[str, set[bytes]]:
        """The hashes each tier holds in KV cache ``group``."""
        with self._lock:
            return {t: {h for h, g in b if g == group} for t, b in self._state.items()}


def _tier_sets() -> dict[str, set[bytes]]:
    return {t: set() for t in TIERS}


@dataclass(slots=True)
class KVEventReplayer:
    """Rebuilds the set of cached hashes per tier from a subscription's
    batches: ``groups[g]`` for KV cache group ``g``, ``tiers`` the first's."""

    tiers: dict[str, set[bytes]] = field(default_factory=_tier_sets)
    last_seq: int | None = None
    groups: dict[int, dict[str, set[bytes]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.groups[0] = self.tiers

    def apply(self, batch: KVEventBatch) -> None:
        if not batch.snapshot:
            if self.last_seq is None:
                raise KVEventGap("the first batch of a subscription must be a snapshot")
            if batch.seq != self.last_seq + 1:
                raise KVEventGap(
                    f"expected batch {self.last_seq + 1}, got {batch.seq}: "
                    "events were lost; resubscribe for a snapshot"
                )
        self.last_seq = batch.seq
        for e in batch.events:
            if type(e) is BlockStored:
                self.groups.setdefault(e.group, _tier_sets())[e.tier].add(e.block_hash)
            elif type(e) is BlockRemoved:
                self.groups.setdefault(e.group, _tier_sets())[e.tier].discard(e.block_hash)
            else:
                for tiers in self.groups.values():
                    for hashes in tiers.values():
                        hashes.clear()
