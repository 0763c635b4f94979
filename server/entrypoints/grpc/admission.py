"""Requests prepared off the event loop reach the engine only while their
client is still there (issue 26 item 4a).

A handler prepares a request (tokenizing, images, bad words) on an executor
thread so the loop keeps streaming. When the client's deadline passes or it
cancels meanwhile, grpc.aio cancels the handler, but the thread goes on: it
used to queue the request anyway, and the engine generated 1,515 tokens for
nobody. Here the thread adds the request under a lock that the cancelled
handler also takes: either the request is not added, or the handler sees it
and aborts it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ClientGoneError(Exception):
    """The client left before its request reached the engine (nobody reads this)."""


class Admission:
    """One request's passage from its executor thread into the engine."""

    __slots__ = ("_engine", "_lock", "_gone", "_stream")

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._gone = False
        self._stream = None

    def check(self) -> None:
        """Raise ClientGoneError if the client has left (before costly work)."""
        if self._gone:
            raise ClientGoneError("the client left while its request was prepared")

    def add_request(self, *args: Any, **kwargs: Any):
        """``engine.add_request``, unless the client has left."""
        with self._lock:
            self.check()
            self._stream = self._engine.add_request(*args, **kwargs)
            return self._stream

    def client_gone(self) -> None:
        with self._lock:
            self._gone = True
            stream = self._stream
        if stream is not None and not stream.finished:
            self._engine.abort(stream.request_id)


async def admit(engine: Any, submit: Callable[[Admission], T]) -> T:
    """Run ``submit(admission)`` on the loop's default executor; it must add
    its request with ``admission.add_request``. If this coroutine is
    cancelled (the client left), a request added anyway is aborted and one
    not added yet never will be."""
    admission = Admission(engine)

    def run() -> T:
        admission.check()  # the client may have left while this waited for a thread
        return submit(admission)

    try:
        return await asyncio.get_running_loop().run_in_executor(None, run)
    except asyncio.CancelledError:
        admission.client_gone()
        raise
