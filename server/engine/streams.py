"""The reader side of the engine: a RequestStream per request, which the
engine thread fills with RequestOutputs and a reader (a thread, or an
asyncio event loop) turns into Chunks, detokenizing off the engine thread.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.request import Request
from tokenbudget.server.engine.output_processor import SampleState


@dataclass(slots=True)
class Chunk:
    """What one read from a RequestStream yields: everything new of one
    sample (``index``) since the last read."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    stop_reason: int | str | None = None
    # Prompt logprobs (entry 0 is None), on the first chunk that follows them.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # A pooling request's vector (1-D float32 tensor), on its last chunk.
    pooling_output: Any = None


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float | None = None
    num_tokens: int = 0


class RequestStream:
    """Iterate for Chunks until every sample of the request has finished.
    Raises the engine's error (ValueError from the scheduler,
    EngineDeadError) instead.

    Read it from a thread (``for chunk in stream``) or from an asyncio event
    loop (``async for chunk in stream``); the engine thread wakes an async
    reader through its loop, once per step for all the loop's streams.
    ``on_stop(engine_request_id)`` is called (on the reader's side) when a
    stop string ends a sample the engine is still running."""

    def __init__(
        self,
        requests: Request | list[Request],
        samples: list[SampleState] | None = None,
        on_stop: Callable[[str], None] | None = None,
        *,
        request_id: str | None = None,
    ) -> None:
        """``samples``: one per request (default: token ids only, no text)."""
        if isinstance(requests, Request):
            requests = [requests]
        if samples is None:
            samples = [SampleState(i, r.sampling_params, None) for i, r in enumerate(requests)]
        self.request_id = request_id or requests[0].request_id
        self.num_prompt_tokens = requests[0].num_prompt_tokens
        # Engine request id -> its sample.
        self.samples = {r.request_id: s for r, s in zip(requests, samples)}
        self._on_stop = on_stop
        self._num_live = len(samples)
        self._prompt_logprobs: list[dict[int, float] | None] | None = None
        self._queue: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self.timing = _Timing(time.monotonic())
        self.num_output_tokens = 0
        # Set by an async reader (on its loop) before it first looks at the queue.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None

    @property
    def finished(self) -> bool:
        """Every sample has finished (its last chunk was read)."""
        return self._num_live == 0

    def put(self, item: RequestOutput | BaseException, *, wake: bool = True) -> None:
        """Queue an item; ``wake=False`` leaves waking an async reader to the
        caller (see wake_async_readers)."""
        self._queue.put(item)
        if wake and self.loop is not None:
            wake_async_readers([self])

    def __iter__(self) -> Iterator[Chunk]:
        while not self.finished:
            yield from self._take(self._queue.get())

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        self._ready = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        while not self.finished:
            # Clear before looking: an item queued after the look sets it again.
            self._ready.clear()
            if self._queue.empty():
                await self._ready.wait()
                continue
            for chunk in self._take(self._queue.get_nowait()):
                yield chunk

    def _take(self, first: RequestOutput | BaseException) -> list[Chunk]:
        items = [first]
        # Coalesce what piled up while the reader was slow: one chunk per sample.
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        by_sample: dict[str, list[RequestOutput]] = {}
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if item.prompt_logprobs:
                self._prompt_logprobs = (self._prompt_logprobs or [None]) + item.prompt_logprobs
            by_sample.setdefault(item.request_id, []).append(item)
        chunks = []
        for rid, outputs in by_sample.items():
            sample = self.samples[rid]
            if sample.finished:
                continue  # stopped by a string while later steps were in flight
            delta = sample.update(outputs)
            if delta is None:
                continue
            chunk = Chunk(
                delta.token_ids,
                delta.text,
                delta.finish_reason,
                max(outputs[-1].num_cached_tokens, 0),
                delta.logprobs,
                delta.index,
                delta.stop_reason,
            )
            chunk.pooling_output = outputs[-1].pooling_output
            if self._prompt_logprobs is not None and chunk.token_ids:
                chunk.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
            self.num_output_tokens += len(chunk.token_ids)
            if sample.finished:
                self._num_live -= 1
                if sample.stopped_by_string and self._on_stop is not None:
                    self._on_stop(rid)
            chunks.append(chunk)
        return chunks


def wake_async_readers(streams: list[RequestStream]) -> None:
    """Wake the async readers of ``streams`` (from any thread): one call into
    each event loop rather than one per stream, since every call writes to
    the loop's self-pipe and a step feeds many streams."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for stream in streams:
        if stream.loop is not None and stream._ready is not None:
            by_loop.setdefault(stream.loop, []).append(stream._ready)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the loop closed: its readers are gone
            pass


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
