"""RemoteExecutor: the core Executor protocol over gRPC workers.

Each worker gets one long-lived ExecuteModel stream. ``execute_model`` sends
the step and returns a Future at once, so the engine can schedule step N+1
while step N runs (async scheduling works remotely too); replies come back in
order and resolve the futures in order.

Several ``--worker`` addresses run in lockstep: every worker gets every step
and the first worker's output is the step's output (the seam where tensor
parallel ranks would go); the KV cache size is the smallest any worker has.
If a stream breaks (a worker died), every pending and later step fails with
WorkerUnavailableError and the failure callbacks fire.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenbudget.proto import convert, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_STOP = object()


class WorkerUnavailableError(ConnectionError):
    """A remote worker cannot be reached or failed a step."""


class _Step:
    """A step sent to every worker; done when each has answered."""

    __slots__ = ("future", "remaining", "output", "req_ids")

    def __init__(self, num_workers: int, req_ids: list[str]) -> None:
        # The step's scheduled order: replies in that order omit their ids.
        self.req_ids = req_ids
        self.future: Future[ModelRunnerOutput] = Future()
        self.remaining = num_workers
        self.output: ModelRunnerOutput | None = None


class _Connection:
    """One worker: its channel, stub and ExecuteModel stream."""

    def __init__(self, address: str, rank: int, options: list[tuple[str, int]]) -> None:
        self.address = address
        self.rank = rank
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: deque[_Step] = deque()
        self.decoder = convert.ModelRunnerOutputDecoder()
        self.reader: threading.Thread | None = None

    def requests(self):
        while (msg := self.outbox.get()) is not _STOP:
            yield msg


class RemoteExecutor:
    def __init__(self, addresses: list[str], model: str, *, dtype: str = "auto",
                 device: str = "", attention_backend: str = "auto",
                 max_message_size: int = 256 << 20, connect_timeout: float = 120.0) -> None:
        if not addresses:
            raise ValueError("RemoteExecutor needs at least one worker address (host:port)")
        options = [("grpc.max_send_message_length", max_message_size),
                   ("grpc.max_receive_message_length", max_message_size)]
        self._conns = [_Connection(a, i, options) for i, a in enumerate(addresses)]
        self._init = worker_pb2.InitializeRequest(
            model=model, dtype=dtype, device=device, attention_backend=attention_backend)
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._step_id = 0
        self._encoder = convert.SchedulerOutputEncoder()
        self._error: WorkerUnavailableError | None = None
        self._failure_callbacks: list[Callable[[BaseException], None]] = []

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self._conns]

    def add_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._failure_callbacks.append(callback)

    def initialize(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> int:
        msg = worker_pb2.InitializeRequest()
        msg.CopyFrom(self._init)
        convert.configs_to_proto(cache_config, scheduler_config, msg)
        num_blocks = []
        for conn in self._conns:
            try:
                grpc.channel_ready_future(conn.channel).result(timeout=self._connect_timeout)
                num_blocks.append(conn.stub.Initialize(msg).num_blocks)
            except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
                raise WorkerUnavailableError(
                    f"worker {conn.address}: initialize failed ({_describe(exc)})") from None
        for conn in self._conns:
            stream = conn.stub.ExecuteModel(conn.requests())
            conn.reader = threading.Thread(target=self._read, args=(conn, stream), daemon=True,
                                           name=f"tokenbudget-remote-{conn.rank}")
            conn.reader.start()
        return min(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        step = _Step(len(self._conns), list(scheduler_output.num_scheduled_tokens))
        with self._lock:
            if self._error is not None:
                step.future.set_exception(self._error)
                return step.future
            self._step_id += 1
            msg = self._encoder.encode(scheduler_output, self._step_id)
            # Queue before sending, under the lock, so replies match in order.
            for conn in self._conns:
                conn.pending.append(step)
                conn.outbox.put(msg)
        return step.future

    def health(self, timeout: float = 5.0) -> bool:
        if self._error is not None:
            return False
        try:
            return all(c.stub.Health(worker_pb2.HealthRequest(), timeout=timeout).healthy
                       for c in self._conns)
        except grpc.RpcError:
            return False

    def shutdown(self) -> None:
        for conn in self._conns:
            conn.outbox.put(_STOP)
        for conn in self._conns:
            if conn.reader is not None:
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
                if conn.rank == 0:
                    step.output = conn.decoder.decode(reply, step.req_ids)
                with self._lock:
                    step.remaining -= 1
                    done = step.remaining == 0
                if done and not step.future.done():
                    step.future.set_result(step.output)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self._error is None and \
                    not conn.pending:
                return  # our own shutdown
            self._fail(WorkerUnavailableError(f"worker {conn.address}: {_describe(exc)}"))
        except WorkerUnavailableError as exc:
            self._fail(exc)
        else:
            if conn.pending:  # the worker ended the stream with steps unanswered
                self._fail(WorkerUnavailableError(f"worker {conn.address} closed the stream"))

    def _fail(self, exc: WorkerUnavailableError) -> None:
        with self._lock:
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
