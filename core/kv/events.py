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


@dataclass(slots=True)
class BlockRemoved:
    block_hash: bytes
    tier: str


@dataclass(slots=True)
class AllCleared:
    """Every tier forgot every block (reset_prefix_cache, or a snapshot's start)."""


KVEvent = BlockStored | BlockRemoved | AllCleared


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
        # As of batch _seq, under the lock: tier -> hash -> (parent, tokens).
        self._state: dict[str, dict[bytes, tuple[bytes | None, list[int]]]] = {t: {} for t in TIERS}
        # Engine thread only: parent and tokens of hashes some tier holds or
        # is about to (a block spilled to the host is stored without them).
        self._meta: dict[bytes, tuple[bytes | None, list[int]]] = {}

    # -- engine thread -----------------------------------------------------------
    def stored(
        self,
        block_hash: bytes,
        tier: str,
        parent_hash: bytes | None = None,
        token_ids: list[int] | None = None,
    ) -> None:
        if token_ids is None:
            parent_hash, token_ids = self._meta[block_hash]
        else:
            self._meta[block_hash] = (parent_hash, token_ids)
        self._pending.append(BlockStored(block_hash, parent_hash, token_ids, tier))

    def removed(self, block_hash: bytes, tier: str) -> None:
        self._pending.append(BlockRemoved(block_hash, tier))

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
                state[e.tier][e.block_hash] = self._meta[e.block_hash] = (
                    e.parent_hash,
                    e.token_ids,
                )
            elif type(e) is BlockRemoved:
                state[e.tier].pop(e.block_hash, None)
                # Forget the tokens of a hash no tier holds any more.
                if all(e.block_hash not in t for t in state.values()):
                    self._meta.pop(e.block_hash, None)
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
            events.extend(BlockStored(h, p, t, tier) for h, (p, t) in blocks.items())
        return KVEventBatch(self._seq, events, snapshot=True, num_dropped=num_dropped)

    def cached_hashes(self) -> dict[str, set[bytes]]:
        with self._lock:
            return {t: set(b) for t, b in self._state.items()}


@dataclass(slots=True)
class KVEventReplayer:
    """Rebuilds the set of cached hashes per tier from a subscription's batches."""

    tiers: dict[str, set[bytes]] = field(default_factory=lambda: {t: set() for t in TIERS})
    last_seq: int | None = None

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
                self.tiers[e.tier].add(e.block_hash)
            elif type(e) is BlockRemoved:
                self.tiers[e.tier].discard(e.block_hash)
            else:
                for hashes in self.tiers.values():
                    hashes.clear()
