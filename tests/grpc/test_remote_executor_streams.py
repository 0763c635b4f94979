"""RemoteExecutor against a scripted in-process worker: the replies each step
gets are the ones that worker sent for it, errors and a vanished worker fail
steps with WorkerUnavailableError, and shutdown leaves nothing behind."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from tokenbudget.core import CacheConfig, SamplingParams, SchedulerConfig
from tokenbudget.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenbudget.proto import step_stream, worker_pb2, worker_pb2_grpc
from tokenbudget.proto.rpc.auth import WorkerSecretInterceptor
from tokenbudget.server.executor.remote import RemoteExecutor, WorkerUnavailableError

REQS = ["a", "b"]
# Every wait is bounded: a step that is never answered fails the test instead of hanging it.
_WAIT = 10


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Samples token step_id * 10 + row for every request; fails step ``fail_at``."""

    def __init__(
        self, fail_at: int | None = None, num_blocks: int = 7, hang_at: int | None = None
    ) -> None:
        """``hang_at``: leave that step unanswered until ``release`` is set."""
        self.fail_at = fail_at
        self.num_blocks = num_blocks
        self.hang_at = hang_at
        self.release = threading.Event()
        self.initialized = 0
        self.sent: dict[int, ModelRunnerOutput] = {}
        self.half_closed = threading.Event()  # the engine ended its stream itself

    def Initialize(self, request, context):
        self.initialized += 1
        return worker_pb2.InitializeResponse(num_blocks=self.num_blocks)

    def ExecuteModel(self, request_iterator, context):
        decoder = step_stream.SchedulerOutputDecoder()
        for msg in request_iterator:
            ids = list(decoder.decode(msg).num_scheduled_tokens)
            if msg.step_id == self.hang_at and self.initialized == 1:
                self.release.wait()
                return
            if msg.step_id == self.fail_at:
                yield worker_pb2.ModelRunnerOutput(step_id=msg.step_id, error="scripted failure")
                return
            out = ModelRunnerOutput(
                ids,
                {r: i for i, r in enumerate(ids)},
                [[msg.step_id * 10 + i] for i in range(len(ids))],
            )
            self.sent[msg.step_id] = out
            yield step_stream.model_runner_output_to_proto(out, msg.step_id, ids)
        self.half_closed.set()

    def Health(self, request, context):
        return worker_pb2.HealthResponse(healthy=True)


@pytest.fixture
def make_worker():
    servers: list[grpc.Server] = []

    def start(
        servicer: ScriptedWorker, port: int = 0, secret: str | None = None
    ) -> tuple[grpc.Server, str]:
        interceptors = [WorkerSecretInterceptor(secret)] if secret else []
        server = grpc.server(
            futures.ThreadPoolExecutor(4, thread_name_prefix="scripted-worker"),
            interceptors=interceptors,
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        return server, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def _connect(address: str, **options) -> RemoteExecutor:
    executor = RemoteExecutor([address], "scripted", connect_timeout=10, **options)
    assert (
        executor.initialize(
            CacheConfig(block_size=4, num_blocks=8), SchedulerConfig(max_model_len=32)
        ).num_blocks
        == 7
    )
    return executor


def _steps(n: int) -> list[SchedulerOutput]:
    """A prefill of REQS, then decode steps."""
    first = SchedulerOutput(
        [
            NewRequestData(r, [5, 6, 7], [], SamplingParams(max_tokens=n), [1 + i], 0)
            for i, r in enumerate(REQS)
        ],
        CachedRequestData(),
        {r: 3 for r in REQS},
        3 * len(REQS),
    )
    decodes = [
        SchedulerOutput(
            [],
            CachedRequestData(list(REQS), [[] for _ in REQS], [3 + k] * len(REQS)),
            {r: 1 for r in REQS},
            len(REQS),
        )
        for k in range(n - 1)
    ]
    return [first, *decodes]


def test_waiting_on_a_later_step_resolves_the_earlier_ones_with_their_own_replies(make_worker):
    worker = ScriptedWorker()
    _, address = make_worker(worker)
    executor = _connect(address)
    try:
        sent = [executor.execute_model(so) for so in _steps(4)]
        last = sent[-1].result(timeout=_WAIT)
        assert all(f.done() for f in sent)
        got = [f.result(timeout=_WAIT) for f in sent[:-1]] + [last]
        assert [(o.req_ids, o.sampled_token_ids) for o in got] == [
            (worker.sent[i].req_ids, worker.sent[i].sampled_token_ids) for i in (1, 2, 3, 4)
        ]
    finally:
        executor.shutdown()


def test_a_step_error_fails_that_step_and_every_later_one_once(make_worker):
    _, address = make_worker(ScriptedWorker(fail_at=2))
    executor = _connect(address)
    failures: list[BaseException] = []
    executor.add_failure_callback(failures.append)
    try:
        sent = [executor.execute_model(so) for so in _steps(3)]
        assert sent[0].result(timeout=_WAIT).sampled_token_ids == [[10], [11]]
        with pytest.raises(WorkerUnavailableError, match="scripted failure"):
            sent[1].result(timeout=_WAIT)
        with pytest.raises(WorkerUnavailableError, match="scripted failure"):
            sent[2].result(timeout=_WAIT)
        with pytest.raises(WorkerUnavailableError):
            executor.execute_model(_steps(1)[0]).result(timeout=_WAIT)
        assert len(failures) == 1 and "scripted failure" in str(failures[0])
        assert not executor.health()
    finally:
        executor.shutdown()


def test_a_worker_vanishing_while_no_step_is_awaited_is_reported_at_once(make_worker):
    server, address = make_worker(ScriptedWorker())
    executor = _connect(address)
    failed = threading.Event()
    executor.add_failure_callback(lambda exc: failed.set())
    try:
        steps = _steps(2)
        executor.execute_model(steps[0]).result(timeout=_WAIT)
        assert executor.health()
        server.stop(0)
        # Nobody waits on a step: the executor must notice by itself.
        assert failed.wait(5.0)
        assert not executor.health()
        with pytest.raises(WorkerUnavailableError):
            executor.execute_model(steps[1]).result(timeout=_WAIT)
    finally:
        executor.shutdown()


def test_shutdown_half_closes_an_idle_stream_and_leaves_no_threads(make_worker):
    worker = ScriptedWorker()
    _, address = make_worker(worker)
    before = set(threading.enumerate())
    executor = _connect(address)
    executor.execute_model(_steps(1)[0]).result(timeout=_WAIT)
    executor.shutdown()
    assert worker.half_closed.wait(5.0)

    def ours() -> set[threading.Thread]:
        return {
            t
            for t in set(threading.enumerate()) - before
            if not t.name.startswith("scripted-worker")
        }

    deadline = time.monotonic() + 5.0
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == set()


def test_shutdown_with_unread_replies_neither_hangs_nor_reports_a_failure(make_worker):
    _, address = make_worker(ScriptedWorker())
    executor = _connect(address)
    failures: list[BaseException] = []
    executor.add_failure_callback(failures.append)
    pending = [executor.execute_model(so) for so in _steps(3)]
    time.sleep(0.2)  # the replies arrive and nobody reads them
    start = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - start < 4.0
    assert failures == []
    assert all(f.done() for f in pending)


# -- the worker's secret, a hung worker, reconnecting ---------------------------------------
def test_a_worker_with_a_secret_refuses_an_executor_without_it(make_worker):
    _, address = make_worker(ScriptedWorker(), secret="s3cret")
    with pytest.raises(WorkerUnavailableError, match="UNAUTHENTICATED.*--worker-secret-file"):
        _connect(address)
    with pytest.raises(WorkerUnavailableError, match="UNAUTHENTICATED"):
        _connect(address, secret="wrong")
    executor = _connect(address, secret="s3cret")
    try:
        assert executor.execute_model(_steps(1)[0]).result(timeout=_WAIT).sampled_token_ids == [
            [10],
            [11],
        ]
        assert executor.health()
    finally:
        executor.shutdown()


def test_a_step_left_unanswered_past_step_timeout_fails_and_reinitialize_recovers(make_worker):
    worker = ScriptedWorker(hang_at=2)
    _, address = make_worker(worker)
    executor = _connect(address, step_timeout=0.5)
    failures: list[BaseException] = []
    executor.add_failure_callback(failures.append)
    try:
        steps = _steps(3)
        assert executor.execute_model(steps[0]).result(timeout=_WAIT).sampled_token_ids == [
            [10],
            [11],
        ]
        hung = executor.execute_model(steps[1])
        sent_at = time.monotonic()
        with pytest.raises(
            WorkerUnavailableError, match="did not answer a step within --worker-step-timeout=0.5 s"
        ):
            hung.result(timeout=_WAIT)
        assert 0.5 <= time.monotonic() - sent_at < 3.0
        assert len(failures) == 1
        # The worker answers again: a new connection, Initialize, a new stream
        # whose steps are numbered from 1 again.
        worker.release.set()
        assert executor.reinitialize().num_blocks == 7 and worker.initialized == 2
        assert executor.execute_model(steps[0]).result(timeout=_WAIT).sampled_token_ids == [
            [10],
            [11],
        ]
        time.sleep(1.0)  # the old stream ending late must not fail the new one
        assert len(failures) == 1 and executor.health()
    finally:
        worker.release.set()
        executor.shutdown()


def test_reinitialize_finds_a_restarted_worker_and_reports_its_kv_size(make_worker):
    server, address = make_worker(ScriptedWorker())
    executor = _connect(address)
    try:
        server.stop(0).wait()  # the port is closed, not closing
        with pytest.raises(WorkerUnavailableError):
            executor.execute_model(_steps(1)[0]).result(timeout=_WAIT)
        with pytest.raises(WorkerUnavailableError, match="initialize failed"):
            executor.reinitialize(connect_timeout=0.5)  # nobody listens yet
        make_worker(ScriptedWorker(num_blocks=5), port=int(address.rsplit(":", 1)[1]))
        assert executor.reinitialize().num_blocks == 5
        assert executor.execute_model(_steps(1)[0]).result(timeout=_WAIT).sampled_token_ids == [
            [10],
            [11],
        ]
    finally:
        executor.shutdown()


class EndsAfterOneStep(ScriptedWorker):
    """Answers step 1, then ends the stream with nothing pending: cleanly, or
    by cancelling the call (what a stopping server's GOAWAY may look like)."""

    def __init__(self, cancel: bool) -> None:
        super().__init__()
        self.cancel = cancel

    def ExecuteModel(self, request_iterator, context):
        for out in super().ExecuteModel(request_iterator, context):
            yield out
            break
        if self.cancel:
            context.cancel()


@pytest.mark.parametrize("cancel", [False, True], ids=["ended", "cancelled"])
def test_a_step_sent_after_an_idle_worker_ended_its_stream_fails_at_once(make_worker, cancel):
    """The worker's stream ends with no step pending and the reader thread is
    gone before the next step is sent: that step fails and the failure is
    reported, rather than the step waiting for nobody."""
    _, address = make_worker(EndsAfterOneStep(cancel))
    executor = _connect(address)
    failures: list[BaseException] = []
    executor.add_failure_callback(failures.append)
    try:
        (conn,) = executor._conns
        first, second = _steps(2)
        assert executor.execute_model(first).result(timeout=_WAIT).sampled_token_ids == [[10], [11]]
        conn.reader.join(timeout=_WAIT)
        assert not conn.reader.is_alive()
        assert len(failures) == 1
        with pytest.raises(WorkerUnavailableError):
            executor.execute_model(second).result(timeout=_WAIT)
    finally:
        executor.shutdown()
    assert len(failures) == 1  # our own shutdown is no failure


def test_shutdown_ends_a_reinitialize_that_waits_on_a_silent_worker():
    """A listening socket that never speaks gRPC (a stopped process looks so):
    reinitialize waits; shutdown ends the wait at once."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        executor = RemoteExecutor([f"127.0.0.1:{silent.getsockname()[1]}"], "scripted")
        outcome: list[BaseException] = []

        def reconnect() -> None:
            try:
                executor.reinitialize(connect_timeout=30)
            except WorkerUnavailableError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=reconnect)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive()
        start = time.monotonic()
        executor.shutdown()
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - start < 3.0
        assert len(outcome) == 1
