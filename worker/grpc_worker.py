"""Serve one Worker over gRPC (service tokenbudget.v1.Worker).

The model is loaded on Initialize (the server sends model path and configs);
then the process's collector policy is applied (core/utils/gc_policy.py: freeze
the loaded heap, raise generation 0's threshold), as the server does after
its start-up, so collections stay out of the steps. ExecuteModel decodes
incoming steps on a reader thread, so decoding step N+1 overlaps the forward
of step N, and answers them strictly in order.

A second Initialize (the server reconnecting after it lost or timed out the
worker) waits for the step in progress, then replaces the model and KV cache;
streams opened before it stop at their next step, so a step the server
abandoned can never touch the new state.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from tokenbudget.core.failures import describe
from tokenbudget.core.lora import LoRAConfig
from tokenbudget.core.utils.gc_policy import DEFAULT_GEN0_THRESHOLD, configure_gc
from tokenbudget.proto import convert, step_stream, worker_pb2, worker_pb2_grpc
from tokenbudget.proto.rpc.auth import WorkerSecretInterceptor
from tokenbudget.proto.rpc.ports import NO_PORT_REUSE, bind_port

logger = logging.getLogger(__name__)

_END = object()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        stop_event: threading.Event | None = None,
        *,
        gc_threshold: int = DEFAULT_GEN0_THRESHOLD,
        worker_factory: Callable[..., Any] | None = None,
    ) -> None:
        """``worker_factory(model, dtype, device, attention_backend, *,
        enforce_eager, lora_config)`` builds the worker on Initialize (default:
        a Worker; tensor-parallel rank 0 passes one that drives its group)."""
        self.worker = None
        self._worker_factory = worker_factory or _local_worker
        self._gc_threshold = gc_threshold
        self._stop_event = stop_event or threading.Event()
        self._lock = threading.Lock()
        # Held while a step runs; Initialize takes it to swap the worker.
        self._step_lock = threading.Lock()
        # Bumped by every Initialize; a stream serves only the one it started in.
        self._generation = 0
        self._num_steps = 0
        self._busy = 0.0
        self._first_step: float | None = None

    def Initialize(self, request, context):
        try:
            cache_config, scheduler_config = convert.configs_from_proto(request)
            lora_config = convert.lora_config_from_proto(request)
        except ValueError as exc:  # before anything is unloaded: the old model serves on
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._lock, self._step_lock:
            self._generation += 1
            if self.worker is not None:
                self.worker.shutdown()
                self.worker = None
                # The old model was frozen: unfreeze so its cycles can be collected.
                gc.unfreeze()
            logger.info(
                "loading %s (dtype=%s, device=%s)",
                request.model,
                request.dtype or "auto",
                request.device or "default",
            )
            self.worker = self._worker_factory(
                request.model,
                request.dtype or "auto",
                request.device,
                request.attention_backend or "auto",
                enforce_eager=(
                    request.enforce_eager if request.HasField("enforce_eager") else None
                ),
                lora_config=lora_config,
            )
            spec = self.worker.initialize(cache_config, scheduler_config)
            policy = configure_gc(self._gc_threshold)
        logger.info("KV cache: %d blocks of %d tokens", spec.num_blocks, cache_config.block_size)
        logger.info(
            "gc: froze %d objects after loading; thresholds %s", policy.frozen, policy.thresholds
        )
        return worker_pb2.InitializeResponse(
            num_blocks=spec.num_blocks,
            num_offload_blocks=spec.num_offload_blocks,
            kv_group_windows=spec.kv_group_windows,
            kv_transfer_handshakes=spec.kv_transfer_handshakes,
        )

    def ExecuteModel(self, request_iterator, context):
        with self._step_lock:
            worker, generation = self.worker, self._generation
        if worker is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "call Initialize first")
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(
            target=_decode_into,
            args=(request_iterator, inbox),
            daemon=True,
            name="tokenbudget-worker-decode",
        ).start()
        while (item := inbox.get()) is not _END:
            step_id, so = item
            start = time.perf_counter()
            if self._first_step is None:
                self._first_step = start
            try:
                if isinstance(so, Exception):
                    raise so  # the step could not be decoded
                with self._step_lock:
                    if self._generation != generation:
                        return  # re-initialized: this stream's engine gave up on it
                    out = worker.execute_model(so)
                self._busy += time.perf_counter() - start
                self._num_steps += 1
            except Exception as exc:  # reported to the engine, which fails the step
                # The traceback stays in this log: the message reaches clients.
                logger.exception("step %d failed", step_id)
                yield worker_pb2.ModelRunnerOutput(step_id=step_id, error=describe(exc).message)
                return
            yield step_stream.model_runner_output_to_proto(
                out, step_id, list(so.num_scheduled_tokens)
            )

    def Health(self, request, context):
        wall = 0.0 if self._first_step is None else time.perf_counter() - self._first_step
        return worker_pb2.HealthResponse(
            healthy=True,
            detail="ready" if self.worker else "not initialized",
            num_steps=self._num_steps,
            busy_seconds=self._busy,
            wall_seconds=wall,
        )

    def Shutdown(self, request, context):
        self._stop_event.set()
        return worker_pb2.ShutdownResponse()


def _local_worker(
    model: str,
    dtype: str,
    device: str,
    attention_backend: str,
    *,
    enforce_eager: bool | None,
    lora_config: LoRAConfig | None,
):
    from tokenbudget.worker.worker import Worker

    return Worker(
        model,
        dtype=dtype,
        device=device or None,
        attention_backend=attention_backend,
        enforce_eager=enforce_eager,
        lora_config=lora_config,
    )


def _decode_into(request_iterator, inbox: queue.SimpleQueue) -> None:
    decoder = step_stream.SchedulerOutputDecoder()  # this stream's request handles
    try:
        for msg in request_iterator:
            try:
                so = decoder.decode(msg)
            except Exception as exc:  # answered as this step's error; the stream ends
                inbox.put((msg.step_id, exc))
                return
            inbox.put((msg.step_id, so))
    except grpc.RpcError:
        pass  # the engine went away; the stream is over
    finally:
        inbox.put(_END)


def serve(
    host: str,
    port: int,
    *,
    max_message_size: int = 256 << 20,
    gc_threshold: int = DEFAULT_GEN0_THRESHOLD,
    secret: str | None = None,
    worker_factory: Callable[..., Any] | None = None,
    stop_event: threading.Event | None = None,
) -> tuple[grpc.Server, int, threading.Event]:
    """Start a worker server; returns (server, bound port, stop event).
    ``gc_threshold`` is generation 0's collector threshold once a model is
    loaded; with a ``secret`` every call must present it (proto/rpc/auth.py)."""
    if gc_threshold < 1:
        raise ValueError(f"gc_threshold must be >= 1, got {gc_threshold}")
    stop = stop_event or threading.Event()
    interceptors = [WorkerSecretInterceptor(secret)] if secret else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", max_message_size),
            ("grpc.max_receive_message_length", max_message_size),
            NO_PORT_REUSE,
        ],
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(
        WorkerServicer(stop, gc_threshold=gc_threshold, worker_factory=worker_factory), server
    )
    bound = bind_port(server, host, port)
    server.start()
    return server, bound, stop
