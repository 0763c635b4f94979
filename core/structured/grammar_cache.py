"""The compiled-grammar cache: futures of compiled grammars by spec key, least
recently used first, bounded by count and by bytes.

Bytes are what a grammar really holds (issue 26 item 13: counting xgrammar's
``memory_size_bytes`` alone, the cache plateaued at about twice its bound in
RSS, and a JSON schema's grammar holds up to 8 times it): the RSS its
compiler process measured it to hold (``measured_bytes``, compile_process.py),
else its ``memory_size_bytes`` times ``overhead``. Once anything is evicted
the C heap's free pages go back to the system (``malloc_trim``), else freed
grammars stay in the process's RSS as holes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import OrderedDict
from concurrent.futures import Future

# RSS per byte of memory_size_bytes of a regex or choice grammar compiled in
# this process (benchmarks/grammar_cache.py --mode thread), for grammars that
# come without a measured size.
SIZE_OVERHEAD = 1.4


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """glibc's malloc_trim(0): free heap pages back to the system (no-op elsewhere)."""
    if _TRIM is not None:
        _TRIM(0)


class GrammarCache:
    """Key -> Future[CompiledGrammar]; a compile in flight counts 0 bytes
    until it is done (``evict`` then counts it)."""

    def __init__(self, max_entries: int, max_bytes: int, overhead: float = SIZE_OVERHEAD) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.overhead = overhead
        self._futures: OrderedDict[tuple[str, bytes], Future] = OrderedDict()

    def __len__(self) -> int:
        return len(self._futures)

    def __contains__(self, key: object) -> bool:
        return key in self._futures

    def get(self, key: tuple[str, bytes]) -> Future | None:
        """The future of ``key`` (made the most recently used), or None."""
        fut = self._futures.get(key)
        if fut is not None:
            self._futures.move_to_end(key)
        return fut

    def put(self, key: tuple[str, bytes], fut: Future) -> None:
        self._futures[key] = fut
        self.evict()

    def drop(self, key: tuple[str, bytes], fut: Future) -> None:
        """Forget ``key`` if it still maps to ``fut`` (a failed or abandoned compile)."""
        if self._futures.get(key) is fut:
            del self._futures[key]

    def size_of(self, fut: Future) -> int:
        """The bytes a done compile holds (0 while compiling or after a failure)."""
        if not fut.done() or fut.cancelled() or fut.exception() is not None:
            return 0
        grammar = fut.result()
        measured = getattr(grammar, "measured_bytes", 0)
        return max(measured, int(grammar.memory_size_bytes * (1 if measured else self.overhead)))

    @property
    def bytes(self) -> int:
        return sum(self.size_of(f) for f in self._futures.values())

    def evict(self) -> None:
        """Drop the least recently used grammars past the count or byte bound."""
        total, evicted = self.bytes, False
        while self._futures and (len(self._futures) > self.max_entries or total > self.max_bytes):
            _, fut = self._futures.popitem(last=False)
            total -= self.size_of(fut)
            evicted = True
        if evicted:
            del fut
            trim_heap()
