"""The waiting queue of policy slo: kept in deadline order as requests come.

The queue owns that order (``arrange``, each step, for ``SLOOrder`` in
core/policy/slo.py): aged requests by arrival, then by TTFT deadline those
that can still make it (a walk that adds up the prefills ahead), then the
late ones by deadline. Sorting and walking the whole queue each step cost
more than the rest of the scheduler once thousands wait. This queue keeps
two sorted indexes instead, updated as requests come and go:

- aged requests (waited past ``aging_bound_s``) by arrival, with the sum of
  their prompt tokens left (what is ahead of every other request);
- the others ("young") by (deadline, arrival).

The clock only moves forward, so a young request whose deadline has passed
is late in every walk (its first token cannot come before now): those form
the front of the young index and need no walk. A step walks only the young
requests still before their deadline, those that came within one TTFT.

The order is the full re-sort's, request for request. Its ties (equal
arrival times) break by the position the queue had; while two waiting
requests share an arrival time the queue does the full re-sort over its
current order instead (``order_all``).

Between two arranges the queue is a view: requests put back in front
(``prepend``), the arranged order, requests that came since (``add``).
Requests taken out are skipped lazily; the indexes change only in
``arrange``.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from tokenbudget.core.request import RequestStatus

if TYPE_CHECKING:
    from tokenbudget.core.request import Request


class WalkSettings(Protocol):
    """What ``arrange`` reads of the policy that owns the queue (SLOOrder)."""

    aging_s: float  # waited longer than this (> 0): served first, by arrival
    step_s: float  # the time one step takes
    reject_late: bool  # late requests are refused (taken out), not queued


def deadline(req: Request) -> float:
    """When the request's first token is due. A request that already has
    output (it was preempted) has met its TTFT: it is never late, and goes
    back ahead of every request still waiting for its first token (only
    the aged go before it)."""
    if req.num_output_tokens:
        return -math.inf
    if req.ttft_ms is None:
        return math.inf
    return req.arrival_time + req.ttft_ms / 1000.0


def walk(
    rest: Iterable[tuple[float, float, int, Request]],
    ahead: int,
    now: float,
    per_step: int,
    step_s: float,
) -> tuple[list[Request], list[Request]]:
    """Split ``rest`` ((deadline, arrival, position, request) in that
    order) into the requests that can still get their first token by
    their deadline with ``ahead`` prompt tokens before them, and the late."""
    on_time: list[Request] = []
    late: list[Request] = []
    for due, _, _, r in rest:
        prefill = len(r.all_token_ids) - r.num_computed_tokens
        # The first token comes at the end of the step that finishes the prefill.
        first_token = now + ((ahead + prefill - 1) // per_step + 1) * step_s
        if first_token > due:
            late.append(r)
        else:
            on_time.append(r)
            ahead += prefill
    return on_time, late


def order_all(
    waiting: list[Request], now: float, per_step: int, aging_s: float, step_s: float
) -> tuple[list[Request], list[Request], list[Request]]:
    """The aged, on-time and late requests of ``waiting`` (in its current
    order, which breaks ties), each in the order they are served: the full
    re-sort that the queue's indexes stand in for."""
    aged: list[Request] = []
    rest: list[tuple[float, float, int, Request]] = []
    bound = now - aging_s if aging_s > 0 else -math.inf
    for i, r in enumerate(waiting):
        arrival = r.arrival_time
        if arrival <= bound:
            aged.append(r)
        else:
            rest.append((deadline(r), arrival, i, r))
    aged.sort(key=lambda r: r.arrival_time)
    # Plainly sorted: ties stay in queue order, as in a stable sort by (deadline, arrival).
    rest.sort()
    # Preempted with output (deadline -inf, sorted first): resumed, never late.
    k = bisect_right(rest, (-math.inf, math.inf))
    aged += [e[3] for e in rest[:k]]
    ahead = sum(r.num_tokens - r.num_computed_tokens for r in aged)
    return (aged, *walk(rest[k:], ahead, now, per_step, step_s))


class _Entry:
    __slots__ = ("deadline", "arrival", "seq", "req", "tokens", "aged")

    def __init__(
        self, deadline: float, arrival: float, seq: int, req: Request, tokens: int
    ) -> None:
        self.deadline = deadline
        self.arrival = arrival
        self.seq = seq
        self.req = req
        self.tokens = tokens  # prompt tokens left to compute
        self.aged = False


class SLOQueue:
    def __init__(self) -> None:
        self._seq = itertools.count()
        self._entries: dict[int, _Entry] = {}  # indexed requests, by id()
        # Young: (deadline, arrival, seq, request), and (arrival, seq, entry) to age them.
        self._young: list[tuple[float, float, int, Request]] = []
        self._young_arrival: list[tuple[float, int, _Entry]] = []
        self._aged_keys: list[tuple[float, int]] = []  # (arrival, seq)
        self._aged: list[Request] = []
        self._aged_tokens = 0
        self._now = -math.inf
        # Indexed requests taken out since the last arrange.
        self._gone: set[int] = set()
        # Requests that came (or came back) since the last arrange, not indexed yet.
        self._new: dict[int, Request] = {}
        # Requests put back by a preemption (it ran since it was keyed, and an
        # in-flight step may still change its tokens): keyed again each arrange.
        self._volatile: set[int] = set()
        self._prepended: set[int] = set()
        self._arrivals: dict[float, int] = {}
        self._ties = 0  # arrival times shared by two or more waiting requests
        self._front: deque[Request] = deque()
        self._stream: Iterator[Request] = iter(())
        self._tail: deque[Request] = deque()
        # The view is front + tail only, and holds no request taken out.
        self._clean = True
        self._len = 0

    # -- the queue interface (FCFSQueue's) ----------------------------------------
    def add(self, request: Request) -> None:
        self._enter(request)
        self._tail.append(request)

    def prepend(self, request: Request) -> None:
        if self._enter(request) and request.status == RequestStatus.PREEMPTED:
            self._prepended.add(id(request))
        self._front.appendleft(request)

    def peek(self) -> Request:
        return self._head()

    def pop(self) -> Request:
        req = self._head()
        self._front.popleft()
        self._leave(req)
        return req

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for req in requests:
            if self._present(req):
                self._leave(req)
                self._clean = False  # the view still holds it

    def reorder(self, ordered: list[Request]) -> None:
        """Take ``ordered`` (the waiting requests, each once) as the order."""
        self._set_view(ordered)

    def evictable_for(self, request: Request) -> Request | None:
        """The queued request ``request`` may take the place of in a full
        queue: none (deadlines order the queue, not ranks)."""
        return None

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        if self._clean:  # the view is a plain list of the waiting requests
            if self._tail:
                self._front.extend(self._tail)
                self._tail.clear()
            return iter(list(self._front))
        present = self._present
        items = [r for r in itertools.chain(self._front, self._stream, self._tail) if present(r)]
        self._set_view(items)
        return iter(items)

    def _set_view(self, ordered: Iterable[Request]) -> None:
        self._front = deque(ordered)
        self._stream = iter(())
        self._tail = deque()
        self._clean = True

    # -- membership ---------------------------------------------------------------
    def _present(self, req: Request) -> bool:
        i = id(req)
        return i in self._new or (i in self._entries and i not in self._gone)

    def _enter(self, req: Request) -> bool:
        """Count ``req`` in; True when it is not indexed (it is new)."""
        i = id(req)
        self._len += 1
        self._count_arrival(req.arrival_time, 1)
        if i in self._gone:  # taken out and put back before the next arrange
            self._gone.discard(i)
            if req.status == RequestStatus.PREEMPTED:
                self._volatile.add(i)
            return False
        self._new[i] = req
        return True

    def _leave(self, req: Request) -> None:
        i = id(req)
        self._len -= 1
        self._count_arrival(req.arrival_time, -1)
        if self._new.pop(i, None) is not None:
            self._prepended.discard(i)
        else:
            self._gone.add(i)

    def _count_arrival(self, arrival: float, delta: int) -> None:
        counts = self._arrivals
        n = counts.get(arrival, 0)
        if delta > 0 and n == 1:
            self._ties += 1
        elif delta < 0 and n == 2:
            self._ties -= 1
        if n + delta:
            counts[arrival] = n + delta
        else:
            del counts[arrival]

    def _head(self) -> Request:
        front, present = self._front, self._present
        while True:
            while front:
                req = front[0]
                if present(req):
                    return req
                front.popleft()
            req = next(self._stream, None)
            if req is None:
                if not self._tail:
                    raise IndexError("the waiting queue is empty")
                req = self._tail.popleft()
            front.append(req)

    # -- arrange --------------------------------------------------------------------
    def arrange(self, order: WalkSettings, now: float, per_step: int) -> list[Request]:
        """Put the waiting requests in deadline order for a step at ``now``
        with ``per_step`` prefill tokens per step (``order``: the settings);
        return the late requests when they are to be refused (taken out of
        the queue then)."""
        # With shared arrival times the order depends on the current one: read it first.
        current = list(self) if self._ties else None
        if now < self._now:  # a clock set back (tests): age everything afresh
            self._unage()
        self._now = now
        self._sync()
        self._age(now - order.aging_s if order.aging_s > 0 else -math.inf)
        if current is not None:
            aged, on_time, late = order_all(current, now, per_step, order.aging_s, order.step_s)
        else:
            aged = self._aged
            young = self._young
            # Preempted with output (deadline -inf): resumed after the aged, never late.
            j = bisect_right(young, (-math.inf, math.inf))
            ahead = self._aged_tokens
            if j:
                resumed = [e[3] for e in itertools.islice(young, j)]
                aged = aged + resumed
                ahead += sum(r.num_tokens - r.num_computed_tokens for r in resumed)
            # Past their deadline: late in any walk, and first among the late.
            k = bisect_left(young, (now,), j)
            on_time, late = walk(
                itertools.islice(young, k, None), ahead, now, per_step, order.step_s
            )
            if k > j:
                late = [e[3] for e in itertools.islice(young, j, k)] + late
        self._front = deque()
        self._tail = deque()
        self._clean = False
        if order.reject_late:
            for req in late:
                self._leave(req)
            self._stream = itertools.chain(aged, on_time)
            return late
        self._stream = itertools.chain(aged, on_time, late)
        return []

    def _sync(self) -> None:
        """Bring the indexes up to date: drop the requests taken out, key
        again the ones a preemption put back, index the new ones."""
        entries = self._entries
        for i in self._gone:
            self._unindex(entries.pop(i))
            self._volatile.discard(i)
        self._gone.clear()
        for i in self._volatile:
            e = entries[i]
            req = e.req
            due, tokens = deadline(req), req.num_tokens - req.num_computed_tokens
            if due != e.deadline or tokens != e.tokens:
                self._unindex(e)
                e.deadline, e.tokens, e.aged = due, tokens, False
                self._index_young(e)
        for i, req in self._new.items():
            e = _Entry(
                deadline(req),
                req.arrival_time,
                next(self._seq),
                req,
                req.num_tokens - req.num_computed_tokens,
            )
            entries[i] = e
            self._index_young(e)
        self._volatile |= self._prepended
        self._prepended.clear()
        self._new.clear()

    def _index_young(self, e: _Entry) -> None:
        insort(self._young, (e.deadline, e.arrival, e.seq, e.req))
        insort(self._young_arrival, (e.arrival, e.seq, e))

    def _unindex(self, e: _Entry) -> None:
        if e.aged:
            j = bisect_left(self._aged_keys, (e.arrival, e.seq))
            del self._aged_keys[j]
            del self._aged[j]
            self._aged_tokens -= e.tokens
        else:
            del self._young[bisect_left(self._young, (e.deadline, e.arrival, e.seq))]
            del self._young_arrival[bisect_left(self._young_arrival, (e.arrival, e.seq))]

    def _age(self, bound: float) -> None:
        """Move the young requests that came at or before ``bound`` to the aged."""
        arrivals = self._young_arrival
        n = 0
        while n < len(arrivals) and arrivals[n][0] <= bound:
            n += 1
        if not n:
            return
        young, aged_keys = self._young, self._aged_keys
        for arrival, seq, e in arrivals[:n]:
            del young[bisect_left(young, (e.deadline, arrival, seq))]
            j = bisect_left(aged_keys, (arrival, seq))
            aged_keys.insert(j, (arrival, seq))
            self._aged.insert(j, e.req)
            self._aged_tokens += e.tokens
            e.aged = True
        del arrivals[:n]

    def _unage(self) -> None:
        for req in self._aged:
            e = self._entries[id(req)]
            e.aged = False
            self._index_young(e)
        self._aged_keys.clear()
        self._aged.clear()
        self._aged_tokens = 0
