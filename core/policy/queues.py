"""Waiting queues. FCFS is a deque; priority orders by (priority, arrival).

Cache-aware policies (core/policy/cache_aware.py) reorder the FCFS queue each
step; policy slo has its own queue (core/policy/slo_queue.py). create_queue
(core/policy/factory.py) makes the configured one.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._q = deque(r for r in self._q if id(r) not in gone)

    def reorder(self, ordered: list[Request]) -> None:
        self._q = deque(ordered)

    def evictable_for(self, request: Request) -> Request | None:
        """The queued request ``request`` may take the place of in a full
        queue: none, first come first served."""
        return None

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lower ``priority`` first, then earlier arrival. A preempted request
    re-enters by its key, which is what a priority user expects."""

    def __init__(self, descending: bool = False) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()
        self._sign = -1 if descending else 1

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap,
            (self._sign * request.priority, request.arrival_time, next(self._seq), request),
        )

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._heap = [e for e in self._heap if id(e[3]) not in gone]
            heapq.heapify(self._heap)

    def worst(self) -> Request:
        """The request that would run last."""
        return max(self._heap)[3]

    def evictable_for(self, request: Request) -> Request | None:
        """The request that would run last, if ``request`` would run strictly
        before it: ``request`` may take its place in a full queue."""
        worst = self.worst()
        sign = self._sign
        return worst if sign * request.priority < sign * worst.priority else None

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))
