"""AsyncEngine: one thread owns the EngineCore; many callers stream from it.

The engine thread is the only one that touches the scheduler. Callers hand it
commands (add, abort, stats) through a queue it drains between steps, so an
abort frees the request's KV blocks before the next step is scheduled. Each
request gets a ``RequestStream``; the engine thread puts RequestOutputs into
it and the reader (a thread or an asyncio event loop) detokenizes, keeping
the engine loop lean.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tokenbudget.core.engine import EngineCore
from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.request import Request
from tokenbudget.core.scheduler import DuplicateRequestError

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine (or a worker it drives) failed; no request can run."""


@dataclass(slots=True)
class Chunk:
    """What one read from a RequestStream yields: everything new since the last read."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_requests: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    encoder_cache_usage: float
    num_generated_tokens: int
    healthy: bool


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float | None = None
    num_tokens: int = 0


class RequestStream:
    """Iterate for Chunks until the one with a finish reason. Raises the
    engine's error (ValueError from the scheduler, EngineDeadError) instead.

    Read it from a thread (``for chunk in stream``) or from an asyncio event
    loop (``async for chunk in stream``); the engine thread wakes an async
    reader through its loop, once per step for all the loop's streams."""

    def __init__(self, request: Request, detokenizer: Any | None) -> None:
        self.request_id = request.request_id
        self.num_prompt_tokens = request.num_prompt_tokens
        self._queue: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self._detokenizer = detokenizer
        self.timing = _Timing(time.monotonic())
        self.num_output_tokens = 0
        # Set by an async reader (on its loop) before it first looks at the queue.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None

    def put(self, item: RequestOutput | BaseException, *, wake: bool = True) -> None:
        """Queue an item; ``wake=False`` leaves waking an async reader to the
        caller (see wake_async_readers)."""
        self._queue.put(item)
        if wake and self.loop is not None:
            wake_async_readers([self])

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            chunk = self._take(self._queue.get())
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        self._ready = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        while True:
            # Clear before looking: an item queued after the look sets it again.
            self._ready.clear()
            if self._queue.empty():
                await self._ready.wait()
                continue
            chunk = self._take(self._queue.get_nowait())
            yield chunk
            if chunk.finish_reason is not None:
                return

    def _take(self, first: RequestOutput | BaseException) -> Chunk:
        items = [first]
        # Coalesce what piled up while the reader was slow: one chunk, one message.
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        chunk = Chunk([], "")
        for item in items:
            if isinstance(item, BaseException):
                raise item
            chunk.token_ids.extend(item.new_token_ids)
            chunk.num_cached_tokens = max(item.num_cached_tokens, 0)
            if item.logprobs is not None:
                chunk.logprobs = (chunk.logprobs or []) + list(item.logprobs)
            chunk.finish_reason = item.finish_reason
        self.num_output_tokens += len(chunk.token_ids)
        if self._detokenizer is not None:
            chunk.text = self._detokenizer.add(chunk.token_ids)
            if chunk.finish_reason is not None:
                chunk.text += self._detokenizer.flush()
        return chunk


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


class AsyncEngine:
    """Thread-safe front of an EngineCore.

    ``input_processor`` (tokenbudget.server.input_processor.InputProcessor)
    tokenizes for the services and gives text deltas; ``metrics``
    (tokenbudget.server.metrics.EngineMetrics) is optional. The keyword
    arguments describe the model for GetModelInfo."""

    def __init__(self, core: EngineCore, input_processor: Any | None = None,
                 metrics: Any | None = None, *, model_name: str = "",
                 eos_token_ids: list[int] | None = None, is_vision_language: bool = False,
                 is_demo: bool = False, num_remote_workers: int = 0) -> None:
        self.core = core
        self.input_processor = input_processor
        self.metrics = metrics
        self.model_name = model_name
        self.eos_token_ids = list(eos_token_ids or [])
        self.is_vision_language = is_vision_language
        self.is_demo = is_demo
        self.num_remote_workers = num_remote_workers
        self.max_model_len = core.scheduler.scheduler_config.max_model_len
        scheduler = core.scheduler
        if scheduler.structured_output_manager is None and input_processor is not None:
            # Structured output needs only the tokenizer; xgrammar loads on first use.
            from tokenbudget.core.structured_output import StructuredOutputManager

            scheduler.structured_output_manager = StructuredOutputManager(
                input_processor.tokenizer, input_processor.vocab_size)
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._commands: list[Callable[[], None]] = []
        self._wakeup = threading.Condition(self._lock)
        self._stopping = False
        self._error: BaseException | None = None
        self._num_generated_tokens = 0
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        add_cb = getattr(core.executor, "add_failure_callback", None)
        if add_cb is not None:
            # A worker dying while the engine idles must still be noticed.
            add_cb(lambda exc: self._submit(lambda: self._raise(exc)))
        self._thread = threading.Thread(target=self._loop, name="tokenbudget-engine", daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        self._death_callbacks.append(callback)

    def add_request(self, request: Request, *, detokenize: bool = True) -> RequestStream:
        """Queue a request; errors found now raise here (DuplicateRequestError,
        ValueError, EngineDeadError), later ones come out of the stream."""
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"prompt has {request.num_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        detok = None
        if detokenize and self.input_processor is not None:
            detok = self.input_processor.detokenizer()
        stream = RequestStream(request, detok)
        with self._lock:
            self._check_alive()
            if request.request_id in self._streams:
                raise DuplicateRequestError(f"request_id {request.request_id!r} already exists")
            self._streams[request.request_id] = stream
            self._commands.append(lambda: self._add(request, stream))
            self._wakeup.notify()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a live request (its stream ends with finish reason "abort");
        False if no such request is live."""
        with self._lock:
            if request_id not in self._streams:
                return False
            self._commands.append(lambda: self._abort(request_id))
            self._wakeup.notify()
        return True

    def get_stats(self, timeout: float = 10.0) -> EngineStats:
        if not self.healthy:
            return self._make_stats()  # the thread is gone; nothing mutates
        fut: Future[EngineStats] = Future()
        self._submit(lambda: fut.set_result(self._make_stats()))
        return fut.result(timeout)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is live; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._streams

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join(timeout=30)
        self._fail_all(EngineDeadError("the engine is shutting down"))
        self.core.shutdown()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
            self._wakeup.notify()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    # -- engine thread -------------------------------------------------------------
    def _loop(self) -> None:
        core = self.core
        try:
            while True:
                with self._lock:
                    while not (self._commands or self._stopping or core.has_unfinished_requests()):
                        self._wakeup.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                for command in commands:
                    command()
                if core.has_unfinished_requests():
                    self._dispatch(core.step())
                    if self.metrics is not None:
                        if core.has_unfinished_requests():
                            self.metrics.maybe_observe_engine(self._make_stats)
                        else:  # going idle: the gauges must not keep the last busy value
                            self.metrics.observe_engine(self._make_stats())
        except BaseException as exc:  # a worker died or the engine has a bug
            logger.exception("engine loop failed; failing every request")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine stopped: {exc}"))
            for callback in self._death_callbacks:
                callback(exc)

    @staticmethod
    def _raise(exc: BaseException) -> None:
        raise exc

    def _add(self, request: Request, stream: RequestStream) -> None:
        try:
            self.core.add_request(request)
        except ValueError as exc:
            self._close(request.request_id)
            stream.put(exc)

    def _abort(self, request_id: str) -> None:
        stream = self._close(request_id)
        if stream is not None:
            self.core.abort_requests([request_id])
            stream.put(RequestOutput(request_id, [], "abort"))

    def _close(self, request_id: str) -> RequestStream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        metrics = self.metrics
        woken: list[RequestStream] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while its step was in flight
            n = len(out.new_token_ids)
            self._num_generated_tokens += n
            timing = stream.timing
            if n and timing.first_token is None:
                timing.first_token = now
            timing.num_tokens += n
            if out.finished:
                self._close(out.request_id)
                if metrics is not None:
                    metrics.observe_finished(timing, now)
            # A request that failed (its grammar did not compile) raises in the reader.
            stream.put(out if out.error is None else out.error, wake=False)
            if stream.loop is not None:
                woken.append(stream)
        if woken:
            wake_async_readers(woken)
        if metrics is not None:
            metrics.observe_tokens(sum(len(o.new_token_ids) for o in outputs))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(exc)

    def _make_stats(self) -> EngineStats:
        s = self.core.scheduler.make_stats()
        pool = self.core.scheduler.kv_cache_manager.block_pool
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_requests=len(self._streams), kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=pool.get_num_free_blocks(),
            num_total_blocks=self.core.scheduler.cache_config.num_blocks - 1,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, encoder_cache_usage=s.encoder_cache_usage,
            num_generated_tokens=self._num_generated_tokens, healthy=self.healthy)

