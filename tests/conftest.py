"""Shared test setup: one torch thread (a busy 2-core box is 10-20x slower with more)."""

from __future__ import annotations

import threading

import contextlib

import pytest

try:
    import torch
except ImportError:  # core-only environments
    torch = None

if torch is not None:
    torch.set_num_threads(1)


@contextlib.contextmanager
def _serving(engine):
    """Host ``engine`` (an AsyncEngine) on the caller's own gRPC server via
    add_generation_servicer, on an ephemeral loopback port; yield a Client.
    The engine is shut down on exit."""
    from concurrent import futures

    import grpc

    from tokenbudget.server.entrypoints.client import Client
    from tokenbudget.server.entrypoints.grpc.generation import add_generation_servicer

    server = grpc.server(futures.ThreadPoolExecutor(8))
    add_generation_servicer(server, engine)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = Client(f"127.0.0.1:{port}")
    try:
        yield client
    finally:
        client.close()
        server.stop(0)
        engine.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> str:
    """The tiny random Qwen3 checkpoint (with its trained tokenizer), built once."""
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_qwen3_path):
    """The transformers oracle for tiny_qwen3_path."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_qwen3_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="session")
def serving():
    return _serving


class OverlapRecorder:
    """An Executor wrapper that records, in order, each step sent
    (``("send", n)``) and each step's result taken by the engine to apply it
    (``("apply", n)``). A step sent while the step before it was still
    unapplied is the overlap async scheduling promises."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.events: list[tuple[str, int]] = []
        self.drafted: set[int] = set()  # steps that verify drafts
        self._index: dict[int, int] = {}  # id(SchedulerOutput) -> its step
        self._sent_events: dict[int, threading.Event] = {}
        self._sent_lock = threading.Lock()
        # Steps the worker ran while the engine had already sent the next one.
        self.worker_overlapped: set[int] = set()

    def _sent(self, n: int) -> threading.Event:
        with self._sent_lock:
            return self._sent_events.setdefault(n, threading.Event())

    def hold_until_next_sent(self, run_step, timeout: float = 0.5):
        """``run_step`` (a worker's execute_model), made to wait before it runs
        step N until the engine has sent step N+1 (at most ``timeout``). The
        worker sees the overlap itself: a blocking or one-in-flight executor,
        or an engine that waits for each step, cannot send N+1 while the
        worker holds N, and ``worker_overlapped`` stays empty."""

        def execute_model(scheduler_output):
            n = self._index.get(id(scheduler_output))
            if n is not None and not scheduler_output.is_empty:
                if self._sent(n + 1).wait(timeout):
                    self.worker_overlapped.add(n)
            return run_step(scheduler_output)

        return execute_model

    def hold_until_another_sent(self, run_step, timeout: float = 0.5):
        """As hold_until_next_sent, for a worker that sees its own copy of
        each step (over gRPC): before it runs a step it waits until the engine
        has sent one more step than it had when the step arrived."""

        def execute_model(scheduler_output):
            sent = sum(1 for kind, _ in self.events if kind == "send")
            if not scheduler_output.is_empty and self._sent(sent).wait(timeout):
                self.worker_overlapped.add(sent)
            return run_step(scheduler_output)

        return execute_model

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # defers_grammar_bitmask and the like

    def initialize(self, cache_config, scheduler_config) -> int:
        return self.inner.initialize(cache_config, scheduler_config)

    def execute_model(self, scheduler_output):
        from concurrent.futures import Future

        n = sum(1 for kind, _ in self.events if kind == "send")
        self.events.append(("send", n))
        self._index[id(scheduler_output)] = n
        self._sent(n).set()
        if scheduler_output.scheduled_spec_decode_tokens:
            self.drafted.add(n)
        inner = self.inner.execute_model(scheduler_output)
        events = self.events

        class Recorded(Future):
            def result(self, timeout=None):
                if ("apply", n) not in events:
                    events.append(("apply", n))
                return inner.result(timeout)

            def cancel(self) -> bool:
                return inner.cancel()

            def done(self) -> bool:
                return inner.done()

        return Recorded()

    def shutdown(self) -> None:
        self.inner.shutdown()

    @property
    def num_overlapped_steps(self) -> int:
        """Steps sent before the result of the step sent just before them was applied."""
        applied: set[int] = set()
        overlapped = 0
        for kind, n in self.events:
            if kind == "apply":
                applied.add(n)
            elif n > 0 and n - 1 not in applied:
                overlapped += 1
        return overlapped

    @property
    def num_steps_beside_drafts(self) -> int:
        """Steps sent while a step verifying drafts was unapplied (they should run alone)."""
        unapplied: set[int] = set()
        beside = 0
        for kind, n in self.events:
            if kind == "apply":
                unapplied.discard(n)
                continue
            beside += bool(unapplied)
            if n in self.drafted:
                unapplied.add(n)
        return beside


@pytest.fixture(scope="session")
def overlap_recorder():
    """The OverlapRecorder class (wrap an executor: ``overlap_recorder(executor)``)."""
    return OverlapRecorder
