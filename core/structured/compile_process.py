"""Grammars compiled in child processes that can be stopped (issue 26 item 4b).

xgrammar's compile cannot be interrupted: in a thread, one that outlived its
timeout ran on (a 200k-alternative regex: +14 CPU-s and +584 MB after its
request had failed). Compile time follows the grammar's structure, not its
size (a 250 KB JSON schema of 10,000 optional properties took 52 s), so no
byte limit bounds it. Here each compile runs in a child process, and one
past its deadline is ended by killing the child; the next compile starts a
new one. The compiled grammar comes back serialized (xgrammar's JSON, about
its size in memory).

Children fork from a multiprocessing forkserver (a fresh process, not a fork
of the threaded server) that has imported xgrammar, and with it torch, once:
a child starts in milliseconds. The first compile waits for the forkserver
to start (seconds); that wait does not count against its deadline.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tokenbudget.core.sampling_params import StructuredOutputParams
from tokenbudget.core.structured.grammar_cache import trim_heap

_PRELOAD = ["__main__", "xgrammar", "tokenbudget.core.structured.grammar"]
_SIZE = struct.Struct("!Q")


class CompileTimeoutError(TimeoutError):
    """A compile ended (its process killed) at its deadline."""


class CompileProcesses:
    """Child compiler processes, one per compile running at once (made on demand)."""

    def __init__(self, tokenizer_info: Callable[[], Any], any_whitespace: bool = False) -> None:
        """``tokenizer_info()``: the parent's xgrammar TokenizerInfo. The
        forkserver starts now, in the background (it takes seconds)."""
        self._get_info = tokenizer_info
        self._any_whitespace = any_whitespace
        self._info = self._setup = None
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()
        self._lock = threading.Lock()
        self.kills = 0  # compiles ended at their deadline
        threading.Thread(target=self._warm_up, name="tokenbudget-grammar-warm", daemon=True).start()

    @staticmethod
    def _warm_up() -> None:
        from multiprocessing import forkserver

        _forkserver()
        try:
            forkserver.ensure_running()
        except Exception:  # the first compile tries again and reports it
            pass

    def compile(self, params: StructuredOutputParams, deadline: float):
        """The CompiledGrammar of ``params``, or CompileTimeoutError once
        ``time.monotonic()`` passes ``deadline`` (the child is killed), or
        ValueError with the compiler's message (EOFError: the child died)."""
        if time.monotonic() >= deadline:  # it waited its time out in the queue
            raise CompileTimeoutError("the grammar compile passed its deadline")
        value: Any = getattr(params, params.kind)
        request = json.dumps({"kind": params.kind, "value": value}).encode()
        # Starting (the tokenizer info, the forkserver, a child) is not the compile's time.
        child, startup = self._take()
        try:
            child.conn.send_bytes(request)
            if not child.conn.poll(max(deadline + startup - time.monotonic(), 0)):
                raise CompileTimeoutError("the grammar compile passed its deadline")
            reply = child.conn.recv_bytes()
        except BaseException:
            self._kill(child)
            raise
        with self._lock:
            self._idle.append(child)
        if reply[:2] != b"ok":
            raise ValueError(reply[2:].decode("utf-8", "replace"))
        import xgrammar as xgr

        (measured,) = _SIZE.unpack_from(reply, 2)
        grammar = xgr.CompiledGrammar.deserialize_json(reply[2 + _SIZE.size :].decode(), self._info)
        # What it holds here, measured by the child (grammar_cache.GrammarCache.size_of).
        grammar.measured_bytes = measured
        del reply
        trim_heap()  # the JSON and its parse were several times the grammar: give them back
        return grammar

    def _take(self) -> tuple[_Child, float]:
        """An idle child, or a new one, and the seconds it took to start."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), 0.0
        start = time.monotonic()
        with self._lock:
            if self._setup is None:
                self._info = self._get_info()
                setup = {"tokenizer_info": self._info.serialize_json()}
                self._setup = json.dumps({**setup, "any_whitespace": self._any_whitespace})
        child = _Child(self._setup.encode())
        with self._lock:
            self._all.add(child)
        return child, time.monotonic() - start

    def _kill(self, child: _Child) -> None:
        with self._lock:
            self._all.discard(child)
            self.kills += 1
        child.stop()

    def shutdown(self) -> None:
        with self._lock:
            children, self._all, self._idle = list(self._all), set(), []
        for child in children:
            child.stop()


def stoppable_compiles(
    enabled: bool, tokenizer_info: Callable[[], Any], any_whitespace: bool = False
) -> CompileProcesses | None:
    """CompileProcesses when ``enabled`` and children can start: they import
    the main module by its path (multiprocessing's rule), which ``python -``
    has none of. None: compile in threads."""
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if not enabled or (main_file is not None and not os.path.isfile(main_file)):
        return None
    return CompileProcesses(tokenizer_info, any_whitespace)


_context_lock = threading.Lock()
_context = None


def _forkserver():
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            _context = ctx
        return _context


class _Child:
    __slots__ = ("proc", "conn")

    def __init__(self, setup: bytes) -> None:
        ctx = _forkserver()
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(theirs, setup), daemon=True, name="tokenbudget-grammar"
        )
        self.proc.start()
        theirs.close()
        self.conn.recv_bytes()  # ready: the tokenizer info is loaded

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


def _serve(conn, setup: bytes) -> None:
    """The child: compile each spec it is sent, one at a time, until the pipe closes."""
    import xgrammar as xgr

    from tokenbudget.core.structured.grammar import parse_grammar, xgrammar_message

    gc.freeze()  # the forkserver's imports (torch, the server) need no collecting here
    options = json.loads(setup)
    info = xgr.TokenizerInfo.deserialize_json(options["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send_bytes(b"ready")
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            params = StructuredOutputParams(**{request["kind"]: request["value"]})
            grammar = parse_grammar(params, any_whitespace=options["any_whitespace"])
            text = compiler.compile_grammar(grammar).serialize_json()
            size = _held_bytes(lambda: xgr.CompiledGrammar.deserialize_json(text, info))
            reply = b"ok" + _SIZE.pack(size) + text.encode()
        except Exception as exc:  # the parent names the field
            reply = b"er" + xgrammar_message(exc).encode("utf-8", "replace")
        conn.send_bytes(reply)


def _held_bytes(make: Callable[[], Any]) -> int:
    """The RSS that ``make()``'s result holds, with the C heap's free pages
    returned before and after (0 where RSS cannot be read): the child is
    single-threaded, so nothing else allocates meanwhile. xgrammar's
    memory_size_bytes misses much of it (a JSON schema's grammar held 8
    times its memory_size_bytes)."""
    try:
        trim_heap()
        before = _rss()
        held = make()
        trim_heap()
        after = _rss()
    except OSError:
        return 0
    del held
    return max(after - before, 0)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
