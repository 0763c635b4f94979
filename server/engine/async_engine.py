"""AsyncEngine: one thread owns the EngineCore; many callers stream from it.

The engine thread is the only one that touches the scheduler. Callers hand it
commands (add, abort, stats) through a queue it drains between steps, so an
abort frees the request's KV blocks before the next step is scheduled. Each
request gets a ``RequestStream`` (server/engine/streams.py); the engine thread
puts RequestOutputs into it and the reader (a thread or an asyncio event
loop) detokenizes, keeping the engine loop lean.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.kv.events import KVEventSubscription
from tokenbudget.core.structured.grammar_cache import trim_heap
from tokenbudget.core.structured.manager import StructuredOutputManager
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.server.engine.engine_stats import EngineStats, make_engine_stats
from tokenbudget.server.engine.lora_registry import LoRARegistry
from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.pooling_params import PoolerConfig
from tokenbudget.core.request import Request
from tokenbudget.core.failures import DuplicateRequestError
from tokenbudget.server.engine.output_processor import SampleState
from tokenbudget.server.engine.stop_strings import StopStrings
from tokenbudget.server.engine.streams import RequestStream, wake_async_readers

logger = logging.getLogger(__name__)

# Seconds the engine idles after work before it trims the C heap.
_TRIM_AFTER_IDLE_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine (or a worker it drives) failed; no request can run."""


class AsyncEngine:
    """Thread-safe front of an EngineCore.

    ``input_processor`` (tokenbudget.server.engine.input_processor.InputProcessor)
    tokenizes for the services and gives text deltas; ``metrics``
    (tokenbudget.server.engine.metrics.EngineMetrics) is optional. The keyword
    arguments describe the model for GetModelInfo."""

    def __init__(
        self,
        core: EngineCore,
        input_processor: Any | None = None,
        metrics: Any | None = None,
        *,
        model_name: str = "",
        eos_token_ids: list[int] | None = None,
        is_vision_language: bool = False,
        is_demo: bool = False,
        num_remote_workers: int = 0,
        served_model_name: str | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        trace_recorder: Any | None = None,
        pooler_config: PoolerConfig | None = None,
        loras: LoRARegistry | None = None,  # the adapters served by name; None: no LoRA
    ) -> None:
        """``trace_recorder``: a server.engine.trace.TraceRecorder that sees
        every accepted request and its output length (no text), for replay.
        ``pooler_config``: the model's default pooling for embedding requests
        (server/engine/pooler_defaults.py; default LAST, normalised)."""
        self.pooler_config = pooler_config or PoolerConfig()
        self.loras = loras
        self.core = core
        self.trace_recorder = trace_recorder
        # Engine request id -> its Request, while recorded and live.
        self._recorded: dict[str, Request] = {}
        self.input_processor = input_processor
        self.metrics = metrics
        self.model_name = model_name  # the path or hub id it was loaded from
        self.served_model_name = served_model_name or model_name
        # SamplingParams keyword -> value for fields a request leaves unset
        # (the model's generation_config; see server/engine/generation_defaults.py).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.eos_token_ids = list(eos_token_ids or [])
        self.is_vision_language = is_vision_language
        self.is_demo = is_demo
        self.num_remote_workers = num_remote_workers
        self.max_model_len = core.scheduler_config.max_model_len
        if input_processor is not None and input_processor.max_model_len is None:
            # Its prompt-bytes limit and max_tokens clamp follow the engine's context.
            input_processor.max_model_len = self.max_model_len
        # Engine request id (one per sample) -> its stream, while the engine runs it.
        self._streams: dict[str, RequestStream] = {}
        # The caller's request id -> its stream, while any of its samples runs.
        self._groups: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._commands: list[Callable[[], None]] = []
        self._wakeup = threading.Condition(self._lock)
        self._stopping = False
        self._error: BaseException | None = None
        # A worker failure the executor reported, for the engine thread to act on.
        self._executor_failure: BaseException | None = None
        self._num_generated_tokens = 0
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._recovery_callbacks: list[Callable[[], None]] = []
        # A worker dying while the engine idles must still be noticed.
        core.add_failure_callback(self._on_executor_failure)
        self._thread = threading.Thread(target=self._loop, name="tokenbudget-engine", daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------
    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.core.scheduler_config

    @property
    def cache_config(self) -> CacheConfig:
        return self.core.cache_config

    @property
    def structured_output(self) -> StructuredOutputManager | None:
        """The engine's grammar manager (None: structured output is off)."""
        return self.core.structured_output

    def subscribe_kv_events(self, max_pending: int) -> KVEventSubscription | None:
        """``EngineCore.subscribe_kv_events`` (None: the events are off)."""
        return self.core.subscribe_kv_events(max_pending)

    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(exc)`` runs (on the engine thread) when the engine stops
        serving: for good, or until its workers are back (see on_recovery)."""
        self._death_callbacks.append(callback)

    def on_recovery(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs (on the engine thread) when reconnected workers
        serve again after a failure."""
        self._recovery_callbacks.append(callback)

    def add_request(
        self,
        request: Request | list[Request],
        *,
        detokenize: bool = True,
        request_id: str | None = None,
    ) -> RequestStream:
        """Queue a request, or the samples of one (request_builder.build_requests,
        ``request_id`` the caller's id for them all); errors found now raise
        here (DuplicateRequestError, ValueError, EngineDeadError), later ones
        come out of the stream."""
        requests = [request] if isinstance(request, Request) else list(request)
        request_id = request_id or requests[0].request_id
        if requests[0].num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {requests[0].num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        samples = []
        stop = requests[0].sampling_params.stop  # the same for every sample
        stop_strings = StopStrings(stop) if stop and detokenize else None  # built once
        for i, r in enumerate(requests):
            params = r.sampling_params
            detok = None
            if detokenize and self.input_processor is not None:
                detok = self.input_processor.detokenizer(
                    params.skip_special_tokens, params.spaces_between_special_tokens
                )
            elif params.stop:
                raise ValueError(
                    "sampling_params.stop: stop strings need the engine to "
                    "detokenize (an input processor, detokenize=True)"
                )
            samples.append(SampleState(i, params, detok, stop_strings))
        stream = RequestStream(requests, samples, self._stop_sample, request_id=request_id)
        with self._lock:
            self._check_alive()
            taken = [
                rid
                for rid in (request_id, *stream.samples)
                if rid in self._streams or rid in self._groups
            ]
            if taken:
                raise DuplicateRequestError(f"request_id {taken[0]!r} already exists")
            self._groups[request_id] = stream
            for rid in stream.samples:
                self._streams[rid] = stream
            self._commands.append(lambda: self._add(requests, stream))
            self._wakeup.notify()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a live request, every sample of it (its stream ends with
        finish reason "abort"); False if no such request is live."""
        with self._lock:
            if request_id not in self._groups:
                return False
            self._commands.append(lambda: self._abort(request_id))
            self._wakeup.notify()
        return True

    def _stop_sample(self, rid: str) -> None:
        # A reader matched a stop string: the engine may still be running the sample.
        self._submit(lambda: self._finish_stopped(rid))

    def get_stats(self, timeout: float = 10.0) -> EngineStats:
        if not self.healthy:
            return self._make_stats()  # the thread is gone; nothing mutates
        fut: Future[EngineStats] = Future()
        self._submit(lambda: fut.set_result(self._make_stats()))
        return fut.result(timeout)

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is live; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._groups and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._groups

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
            reconnecting = self._error is not None and self._thread.is_alive()
        if reconnecting:
            # The engine thread may wait on a hung worker's Initialize: closing
            # the executor's connections ends that wait.
            self.core.executor.shutdown()
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
        while True:
            try:
                self._run()
                return  # shutting down
            except BaseException as exc:  # a worker died or hung, or the engine has a bug
                recoverable = self.core.can_recover(exc) and not self._stopping
                if not recoverable:
                    logger.exception("engine loop failed; failing every request")
                self._stop_serving(exc)
                if not recoverable or not self._reconnect():
                    return

    def _run(self) -> None:
        core = self.core
        trimmed = True
        while True:
            with self._lock:
                while not (
                    self._commands
                    or self._stopping
                    or self._executor_failure
                    or core.has_unfinished_requests()
                ):
                    # Idle for a second after work: hand the C heap's free
                    # pages back (what requests and refused messages left).
                    if not self._wakeup.wait(None if trimmed else _TRIM_AFTER_IDLE_S):
                        trim_heap()
                        trimmed = True
                if self._stopping:
                    return
                if self._executor_failure is not None:
                    raise self._executor_failure
                commands, self._commands = self._commands, []
            for command in commands:
                command()
            if core.has_unfinished_requests():
                trimmed = False
                self._dispatch(core.step())
                if self.metrics is not None:
                    if core.has_unfinished_requests():
                        self.metrics.maybe_observe_engine(self._make_stats)
                    else:  # going idle: the gauges must not keep the last busy value
                        self.metrics.observe_engine(self._make_stats())

    def _on_executor_failure(self, exc: BaseException) -> None:
        with self._lock:
            self._executor_failure = exc
            self._wakeup.notify()

    def _stop_serving(self, exc: BaseException) -> None:
        """Fail every request with ``exc`` and forget them, so stats show none
        running; the death callbacks report the engine unhealthy."""
        with self._lock:  # from here on add_request refuses
            self._error = exc
        self._fail_all(EngineDeadError(f"the engine stopped: {exc}"))
        try:
            self.core.discard_requests()
        except Exception:  # a scheduler broken by a bug: stats may still show its requests
            logger.exception("could not discard the failed requests")
        self._recorded.clear()
        if self.metrics is not None:
            self.metrics.observe_engine(self._make_stats())
        for callback in self._death_callbacks:
            callback(exc)

    def _reconnect(self) -> bool:
        """Reinitialise the workers, retrying with backoff (0.5 s doubling to
        10 s) until they answer; False if the engine shuts down first."""
        delay = 0.5
        while True:
            with self._lock:
                self._executor_failure = None
                if self._stopping:
                    return False
            try:
                self.core.reinitialize()
            except ConnectionError as exc:
                logger.warning("workers unreachable (%s); retrying in %.1f s", exc, delay)
                with self._lock:
                    self._wakeup.wait_for(lambda: self._stopping, delay)
                delay = min(delay * 2, 10.0)
                continue
            # A smaller cache may have lowered max_model_len: new requests' limits follow.
            self.max_model_len = self.core.scheduler_config.max_model_len
            if self.input_processor is not None:
                self.input_processor.max_model_len = self.max_model_len
            with self._lock:
                if self._executor_failure is not None:  # failed again at once
                    continue
                self._error = None
            logger.info("workers reinitialised: serving again")
            for callback in self._recovery_callbacks:
                callback()
            return True

    def _add(self, requests: list[Request], stream: RequestStream) -> None:
        if self._streams.get(requests[0].request_id) is not stream:
            return  # failed with the engine after it was queued
        added = []
        try:
            for request in requests:
                self.core.add_request(request)
                added.append(request.request_id)
                if self.trace_recorder is not None:
                    self.trace_recorder.on_add(request)
                    self._recorded[request.request_id] = request
        except ValueError as exc:
            self.core.abort_requests(added)
            for rid in stream.samples:
                self._close(rid)
            stream.put(exc)

    def _abort(self, request_id: str) -> None:
        stream = self._groups.get(request_id)
        if stream is None:
            return
        live = [rid for rid in stream.samples if self._close(rid) is not None]
        self.core.abort_requests(live)
        for rid in live:
            self._recorded.pop(rid, None)  # an aborted request has no output length
        for rid in live:
            stream.put(RequestOutput(rid, [], "abort"))

    def _finish_stopped(self, rid: str) -> None:
        if self._sample_done(rid, time.monotonic(), "stop"):
            self.core.stop_requests([rid])

    def _sample_done(self, rid: str, now: float, finish_reason: str | None) -> bool:
        """A sample finished; False if it was no longer live."""
        stream = self._close(rid)
        if stream is None:
            return False
        recorded = self._recorded.pop(rid, None)
        if recorded is not None:
            self.trace_recorder.on_finish(rid, recorded.num_output_tokens)
        if self.metrics is not None and stream.request_id not in self._groups:
            # The request's last sample.
            self.metrics.observe_finished(
                stream.timing,
                now,
                request_id=stream.request_id,
                num_prompt_tokens=stream.num_prompt_tokens,
                finish_reason=finish_reason,
            )
        return True

    def _close(self, rid: str) -> RequestStream | None:
        """Forget a sample the engine no longer runs (and its stream with its last one)."""
        with self._lock:
            stream = self._streams.pop(rid, None)
            if stream is not None and not any(r in self._streams for r in stream.samples):
                self._groups.pop(stream.request_id, None)
            return stream

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
                self._sample_done(out.request_id, now, out.finish_reason)
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
            streams, self._streams, self._groups = self._groups, {}, {}
        for stream in streams.values():
            stream.put(exc)

    def _make_stats(self) -> EngineStats:
        return make_engine_stats(
            self.core, len(self._groups), self._num_generated_tokens, self.healthy
        )
