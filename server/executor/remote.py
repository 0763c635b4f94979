"""RemoteExecutor: the Executor over gRPC workers.

Each worker gets one long-lived ExecuteModel stream. ``execute_model`` sends
the step and returns a Future at once, so the engine can schedule step N+1
while step N runs (async scheduling works remotely too); replies come back in
order and resolve the futures in order.

Several ``--worker`` addresses run in lockstep: every worker gets every step
and the first worker's output is the step's output (the seam where tensor
parallel ranks would go); the KV cache size is the smallest any worker has.
If a stream breaks (a worker died) or a worker leaves a step unanswered for
longer than ``step_timeout`` (it hangs), every pending and later step fails
with WorkerUnavailableError and the failure callbacks fire. ``step_timeout``
is a long allowance (a first step's lazy set-up, a cold prefill); once a
worker has answered HANG_MIN_STEPS steps its bound tightens to
``hang_timeout``, or HANG_FACTOR times the slowest step it answered after
the first if that is longer (never past ``step_timeout``), so a worker that
stops answering is found in seconds, not minutes. ``reinitialize``
then reconnects (new channels), sends the same Initialize again and opens new
streams: the engine calls it, with backoff, until the workers are back.

With disaggregated prefill/decode the KVCacheSpec lists every worker's KV
transfer handshake in address order (a tensor-parallel rank 0 answers for
its group's ranks), and a KV send counts finished only once every worker
reported it, failed if any failed it (proto/kv_connector.py KVSendTally).

With a ``secret``, every call carries ``authorization: Bearer <secret>``
metadata, which workers started with ``--worker-secret-file`` require.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.lora import LoRAConfig
from tokenbudget.core.outputs import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenbudget.proto import convert, step_stream, worker_pb2, worker_pb2_grpc
from tokenbudget.proto.kv_connector import KVSendTally, kv_sending_from_proto
from tokenbudget.server.executor.base import Executor

logger = logging.getLogger(__name__)

_STOP = object()
# Steps a worker answers before its step times bound a hang (the first one may
# carry lazy set-up and is not a sample), and how far past the slowest sampled
# step a step may run before the worker is declared hung.
HANG_MIN_STEPS = 2
HANG_FACTOR = 20.0


class WorkerUnavailableError(ConnectionError):
    """A remote worker cannot be reached or failed a step."""


class _Step:
    """A step sent to every worker; done when each has answered."""

    __slots__ = ("future", "remaining", "output", "req_ids", "kv_sending")

    def __init__(self, num_workers: int, req_ids: list[str]) -> None:
        # The step's scheduled order: replies in that order omit their ids.
        self.req_ids = req_ids
        self.future: Future[ModelRunnerOutput] = Future()
        self.remaining = num_workers
        self.output: ModelRunnerOutput | None = None
        # Several workers: each one's (finished_sending, failed_sending), by rank.
        self.kv_sending: list = [None] * num_workers if num_workers > 1 else []


class _Connection:
    """One worker: its channel, stub and ExecuteModel stream."""

    def __init__(self, address: str, rank: int, options: list[tuple[str, int]]) -> None:
        self.address = address
        self.rank = rank
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: deque[_Step] = deque()
        self.decoder = step_stream.ModelRunnerOutputDecoder()
        self.reader: threading.Thread | None = None
        self.ready = grpc.channel_ready_future(self.channel)
        # When the worker last answered, or was sent a step while idle: the
        # watchdog measures how long the oldest pending step has been its turn.
        self.waiting_since = 0.0
        self.answered = 0
        self.slowest = 0.0  # the longest turn of a step it answered after its first

    def answer(self, now: float) -> None:
        """The oldest pending step was answered at ``now``."""
        self.answered += 1
        if self.answered > 1:
            self.slowest = max(self.slowest, now - self.waiting_since)
        self.waiting_since = now

    def requests(self):
        while (msg := self.outbox.get()) is not _STOP:
            yield msg


class RemoteExecutor(Executor):
    # The server flag that sets ``connect_timeout``, named when it runs out.
    connect_timeout_flag = "--worker-connect-timeout"

    def __init__(
        self,
        addresses: list[str],
        model: str,
        *,
        dtype: str = "auto",
        device: str = "",
        attention_backend: str = "auto",
        max_message_size: int = 256 << 20,
        connect_timeout: float = 120.0,
        step_timeout: float = 0.0,
        hang_timeout: float = 0.0,
        secret: str | None = None,
        enforce_eager: bool | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """``lora_config``: the workers serve LoRA adapters (None: off);
        ``connect_timeout``: how long initialize waits for a worker to accept
        the connection; ``step_timeout`` (seconds, 0 = never): a worker that
        leaves a step unanswered that long is declared hung; ``hang_timeout``
        (0 = off): the tighter bound once it has answered steps (see above)."""
        if not addresses:
            raise ValueError("RemoteExecutor needs at least one worker address (host:port)")
        for name, seconds in (("step_timeout", step_timeout), ("hang_timeout", hang_timeout)):
            if seconds < 0:
                raise ValueError(f"{name} must be >= 0, got {seconds}")
        self._addresses = list(addresses)
        self._options = [
            ("grpc.max_send_message_length", max_message_size),
            ("grpc.max_receive_message_length", max_message_size),
            # While a worker restarts, retry the connection every
            # 0.25-2 s (gRPC's default backs off to 2 min), so
            # it is found within 2 s of listening.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self._metadata = (("authorization", f"Bearer {secret}"),) if secret else ()
        self._conns: list[_Connection] = []
        # Connections being initialised: shutdown closes them too, which ends
        # an Initialize that a hung worker would leave unanswered.
        self._connecting: list[_Connection] = []
        self._init = worker_pb2.InitializeRequest(
            model=model,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,  # None leaves it unset: the worker's default
        )
        convert.lora_config_to_proto(lora_config, self._init)
        self._connect_timeout = connect_timeout
        self._step_timeout = step_timeout
        self._hang_timeout = hang_timeout
        self._lock = threading.Lock()
        self._step_id = 0
        self._encoder = step_stream.SchedulerOutputEncoder()
        self._kv_tally = KVSendTally(len(addresses))
        self._error: WorkerUnavailableError | None = None
        self._failure_callbacks: list[Callable[[BaseException], None]] = []
        self._closed = threading.Event()

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    def add_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._failure_callbacks.append(callback)

    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        # Kept as sent: reinitialize asks the workers for the same configuration.
        convert.configs_to_proto(cache_config, scheduler_config, self._init)
        flag = self.connect_timeout_flag
        spec = self._connect(
            self._connect_timeout,
            f"{flag}={self._connect_timeout:g} s" if flag else f"{self._connect_timeout:g} s",
        )
        if self._step_timeout or self._hang_timeout:
            threading.Thread(
                target=self._watch, daemon=True, name="tokenbudget-remote-watchdog"
            ).start()
        return spec

    @property
    def can_reinitialize(self) -> bool:
        return True

    def reinitialize(self, connect_timeout: float = 10.0) -> KVCacheSpec:
        """After a failure: drop the old connections, reconnect to every worker
        (a worker has ``connect_timeout`` seconds to accept the connection, then
        as long as initialize allows to load the model), initialize it with the
        same configuration and open new streams; returns the KV cache the
        workers now have. Raises WorkerUnavailableError if one cannot be
        reached; the caller retries with backoff."""
        self._close_connections()
        spec = self._connect(connect_timeout, f"{connect_timeout:g} s")
        with self._lock:
            self._error = None
        logger.info(
            "workers %s are back (%d KV blocks)", ", ".join(self._addresses), spec.num_blocks
        )
        return spec

    def _connect(self, connect_timeout: float, timeout_setting: str) -> KVCacheSpec:
        """``timeout_setting``: ``connect_timeout`` as the user can change it,
        for the error when a worker does not accept the connection in time."""
        conns = [_Connection(a, i, self._options) for i, a in enumerate(self._addresses)]
        with self._lock:
            if self._closed.is_set():
                raise WorkerUnavailableError("the executor is shut down")
            self._connecting = conns
        num_blocks, num_offload, windows, handshakes = [], [], set(), []
        try:
            for conn in conns:
                try:
                    conn.ready.result(timeout=connect_timeout)
                    # No deadline: loading a large model may take minutes.
                    reply = conn.stub.Initialize(self._init, metadata=self._metadata)
                    num_blocks.append(reply.num_blocks)
                    num_offload.append(reply.num_offload_blocks)
                    windows.add(tuple(reply.kv_group_windows))
                    handshakes.extend(reply.kv_transfer_handshakes)  # in rank order
                except grpc.FutureTimeoutError:
                    raise WorkerUnavailableError(
                        f"worker {conn.address}: initialize failed (nothing accepted the "
                        f"connection within {timeout_setting})"
                    ) from None
                except (grpc.FutureCancelledError, grpc.RpcError) as exc:
                    raise WorkerUnavailableError(
                        f"worker {conn.address}: initialize failed ({_describe(exc)})"
                    ) from None
        except WorkerUnavailableError:
            for conn in conns:
                conn.channel.close()
            raise
        finally:
            with self._lock:
                self._connecting = []
        with self._lock:
            self._conns = conns
            self._step_id = 0
            self._encoder = step_stream.SchedulerOutputEncoder()  # request handles are per stream
            self._kv_tally = KVSendTally(len(conns))  # the old workers' sends died with them
        for conn in conns:
            stream = conn.stub.ExecuteModel(conn.requests(), metadata=self._metadata)
            conn.reader = threading.Thread(
                target=self._read,
                args=(conn, stream),
                daemon=True,
                name=f"tokenbudget-remote-{conn.rank}",
            )
            conn.reader.start()
        # The smallest cache any worker has; host KV tier slots likewise (0: none).
        # Ranks of one model have the same KV cache groups. A peer engine
        # writes into worker i's KV through handshake i (disaggregation).
        return KVCacheSpec(
            min(num_blocks),
            min(num_offload),
            min(windows),
            kv_transfer_handshakes=tuple(handshakes),
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        step = _Step(len(self._conns), list(scheduler_output.num_scheduled_tokens))
        with self._lock:
            if self._error is not None:
                step.future.set_exception(self._error)
                return step.future
            self._step_id += 1
            msg = self._encoder.encode(scheduler_output, self._step_id)
            now = time.monotonic()
            # Queue before sending, under the lock, so replies match in order.
            for conn in self._conns:
                if not conn.pending:
                    conn.waiting_since = now
                conn.pending.append(step)
                conn.outbox.put(msg)
        return step.future

    def health(self, timeout: float = 5.0) -> bool:
        if self._error is not None:
            return False
        try:
            return all(
                c.stub.Health(
                    worker_pb2.HealthRequest(), metadata=self._metadata, timeout=timeout
                ).healthy
                for c in self._conns
            )
        except grpc.RpcError:
            return False

    def shutdown(self) -> None:
        self._closed.set()
        self._close_connections(join=True)

    def _close_connections(self, join: bool = False) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            connecting = self._connecting
        for conn in connecting:
            conn.ready.cancel()  # closing the channel does not end a wait for it
            conn.channel.close()
        for conn in conns:
            conn.outbox.put(_STOP)
        for conn in conns:
            if join and conn.reader is not None:
                conn.reader.join(timeout=5)
            conn.channel.close()

    # -- reader threads --------------------------------------------------------------
    def _read(self, conn: _Connection, stream) -> None:
        try:
            for reply in stream:
                if not conn.pending:
                    return  # another worker failed and cleared every pending step
                if reply.error:  # the step stays pending: _fail fails it with the rest
                    raise WorkerUnavailableError(f"worker {conn.address}: {reply.error}")
                step = conn.pending.popleft()
                conn.answer(time.monotonic())
                if conn.rank == 0:
                    step.output = conn.decoder.decode(reply, step.req_ids)
                if step.kv_sending:
                    step.kv_sending[conn.rank] = kv_sending_from_proto(reply)
                with self._lock:
                    step.remaining -= 1
                    done = step.remaining == 0
                    if done and step.kv_sending:  # in step order: the tally spans steps
                        merged = self._kv_tally.merge(step.kv_sending)
                        step.output.finished_sending, step.output.failed_sending = merged
                if done and not step.future.done():
                    step.future.set_result(step.output)
        except grpc.RpcError as exc:
            self._fail(WorkerUnavailableError(f"worker {conn.address}: {_describe(exc)}"), conn)
        except WorkerUnavailableError as exc:
            self._fail(exc, conn)
        else:
            # The worker ended the stream, even with no step pending (a stopped
            # server's GOAWAY): a step sent after it would wait for nobody.
            self._fail(WorkerUnavailableError(f"worker {conn.address} closed the stream"), conn)
        # Our own shutdown or reinitialize drops ``conn`` from _conns before it
        # ends the stream, so _fail ignores the end of a stream we closed.

    def _watch(self) -> None:
        """Declare a worker hung when its oldest pending step has waited longer
        than its bound (``step_bound``) since the worker last answered."""
        bounds = [t for t in (self._step_timeout, self._hang_timeout) if t]
        while not self._closed.wait(min(min(bounds) / 4, 1.0)):
            now = time.monotonic()
            for conn in list(self._conns):
                bound, why = self.step_bound(conn)
                if conn.pending and bound and now - conn.waiting_since > bound:
                    self._fail(
                        WorkerUnavailableError(
                            f"worker {conn.address} did not answer a step within "
                            f"{why} (hung or overloaded)"
                        ),
                        conn,
                    )

    def step_bound(self, conn: _Connection) -> tuple[float, str]:
        """(seconds a step may go unanswered, 0 = no bound; what set it)."""
        first = (self._step_timeout, f"--worker-step-timeout={self._step_timeout:g} s")
        if not self._hang_timeout or conn.answered < HANG_MIN_STEPS:
            return first
        scaled = max(self._hang_timeout, HANG_FACTOR * conn.slowest)
        if self._step_timeout and scaled >= self._step_timeout:
            return first
        if scaled > self._hang_timeout:
            return scaled, f"{scaled:g} s ({HANG_FACTOR:g}x its slowest step)"
        return scaled, f"--worker-hang-timeout={self._hang_timeout:g} s"

    def _fail(self, exc: WorkerUnavailableError, conn: _Connection) -> None:
        with self._lock:
            if conn not in self._conns:
                return  # a connection reinitialize already replaced
            first = self._error is None
            if first:
                self._error = exc
            pending = [s for c in self._conns for s in c.pending]
            for c in self._conns:
                c.pending.clear()
        if first:
            # Before the futures: whoever sees a failed step can count on the
            # failure having been reported.
            logger.error("%s", exc)
            for callback in self._failure_callbacks:
                callback(exc)
        for step in pending:
            if not step.future.done():
                step.future.set_exception(exc)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
