"""A request's stop strings as one Aho-Corasick automaton (pyahocorasick):
each token's text is fed once to a sample's cursor, at a cost that grows
with the text and not with the number of strings (issue 26: 100k strings,
each searched on every token, took 25-70 ms per token on the event loop
that streams every client's tokens).

Every prefix of every stop string is a key of the automaton (a prefix is a
trie node already, so this costs no nodes): the keys that end where the
text ends are exactly the ends of the text that may still grow into a stop
string, which is what a sample holds back, so one pass finds both.

Built once per request, off the event loop (while the request is prepared),
and shared by its samples; each sample has its own StopCursor.
"""

from __future__ import annotations

import ahocorasick


class StopStrings:
    """The automaton of a request's stop strings (immutable once built)."""

    __slots__ = ("strings", "longest", "_automaton")

    def __init__(self, strings: list[str]) -> None:
        if not strings:
            raise ValueError("StopStrings needs at least one string")
        self.strings = strings
        self.longest = max(len(s) for s in strings)
        automaton = ahocorasick.Automaton()
        # A key that only begins stop strings -> its length (an int, the common
        # case, cheap to skip); a whole stop string -> (its index, its length,
        # whether a longer one begins with it). A repeat keeps its first index.
        for index, s in enumerate(strings):
            for j in range(1, len(s) + 1):
                key = s[:j]
                known = automaton.get(key, None)
                if j < len(s):
                    value = j if known is None or known.__class__ is int else (*known[:2], True)
                elif known is None or known.__class__ is int:
                    value = (index, j, known is not None)
                else:
                    continue  # a repeated string
                automaton.add_word(key, value)
        automaton.make_automaton()
        self._automaton = automaton

    def cursor(self) -> StopCursor:
        return StopCursor(self)


class StopCursor:
    """One sample's place in the automaton; ``feed`` each piece of its text."""

    __slots__ = ("strings", "_iter", "num_chars", "_tail")

    def __init__(self, stop: StopStrings) -> None:
        self.strings = stop.strings
        self._iter = stop._automaton.iter("")
        self.num_chars = 0  # characters fed so far
        # Lengths of the text's ends that begin a longer stop string.
        self._tail: list[int] = []

    def feed(self, piece: str) -> tuple[int, str] | None:
        """Feed the next characters; returns the earliest-starting stop
        string that ends in them (ties: the one listed first) as (its start
        among all characters fed, the string), or None."""
        if not piece:
            return None
        self.num_chars += len(piece)
        last = self.num_chars - 1
        best: tuple[int, int] | None = None  # (start, index)
        tail: list[int] = []
        self._iter.set(piece, False)  # go on from where the last piece left the automaton
        for end, value in self._iter:
            if value.__class__ is int:  # a proper prefix of some string, of this length
                if end == last:
                    tail.append(value)
                continue
            index, length, longer = value
            if best is None or (end - length + 1, index) < best:
                best = (end - length + 1, index)
            if longer and end == last:
                tail.append(length)
        self._tail = tail
        return None if best is None else (best[0], self.strings[best[1]])

    def held_back(self, at_most: int) -> int:
        """The longest end of the text fed, at most ``at_most`` characters,
        that begins some stop string without being a whole one."""
        return max((n for n in self._tail if n <= at_most), default=0)
