"""The gRPC front's lifecycle: ``start`` binds the port and registers the
services (our Generation, the SGLang gateway's worker protocol, health and
reflection), ``drain`` refuses new requests and waits for those in flight,
``stop`` shuts the engine and the server down.

grpc.aio: every stream is a coroutine on one event loop, which costs about
half the CPU per streamed token of a thread per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

logger = logging.getLogger("tokenbudget.server")

_REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def serve(args: argparse.Namespace, engine) -> int:
    """Run the gRPC server until SIGTERM/SIGINT; returns the exit status.
    Raises BindError (the engine shut down) when the port cannot be bound."""
    return asyncio.run(_serve(args, engine))


async def _serve(args: argparse.Namespace, engine) -> int:
    frontend = GrpcFrontend(args, engine)
    # Before the port opens (and the "listening" line is printed): a SIGTERM
    # that arrives the moment the server is up must drain it, not kill it.
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await frontend.start()
    gateway = None
    if getattr(args, "openai_port", None) is not None:
        gateway = await _start_gateway(args, engine, frontend.port, stop)
    await stop.wait()
    loop = asyncio.get_running_loop()
    if gateway is not None:  # first: no new HTTP requests while the server drains
        await loop.run_in_executor(None, gateway.stop)
    await frontend.drain()
    await frontend.stop()
    return 1 if gateway is not None and gateway.failed_with is not None else 0


async def _start_gateway(args: argparse.Namespace, engine, grpc_port: int, stop: asyncio.Event):
    """server --openai-port: the SGLang gateway in front (openai_gateway.py);
    if it exits, ``stop`` is set and the server stops with status 1."""
    from tokenbudget.server.entrypoints.openai_gateway import Gateway

    loop = asyncio.get_running_loop()
    connect = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    gateway = Gateway.start(
        host=args.host,
        port=args.openai_port,
        grpc_address=f"{connect}:{grpc_port}",
        model=engine.model_name,
        log_level=args.log_level,
        on_exit=lambda status: loop.call_soon_threadsafe(stop.set),
    )
    if await loop.run_in_executor(None, gateway.wait_ready):
        print(
            f"OpenAI API (SGLang gateway, pid {gateway.proc.pid}) on "
            f"http://{args.host}:{args.openai_port}/v1",
            flush=True,
        )
    else:
        logger.error("the SGLang gateway did not start serving this server")
        stop.set()
    return gateway


class GrpcFrontend:
    """One engine served on one port, from start through drain to stop."""

    def __init__(self, args: argparse.Namespace, engine) -> None:
        self.args = args
        self.engine = engine
        self.server: Any = None
        self.port = 0  # the bound gRPC port, once started
        self.servicer: Any = None
        self.sglang: Any = None
        self.health: Any = None
        self._health_lock = asyncio.Lock()  # a death and a recovery apply in order

    async def start(self) -> None:
        import grpc

        from tokenbudget.proto.rpc.ports import NO_PORT_REUSE, bind_port
        from tokenbudget.server.entrypoints.grpc import sglang as sglang_service
        from tokenbudget.server.entrypoints.grpc.generation import add_generation_servicer
        from tokenbudget.server.entrypoints.grpc.security import server_credentials

        args, engine = self.args, self.engine
        self.server = grpc.aio.server(
            interceptors=self._interceptors(),
            options=[
                ("grpc.max_receive_message_length", args.max_message_size),
                ("grpc.max_send_message_length", args.max_message_size),
                NO_PORT_REUSE,
            ],
        )
        try:
            port = bind_port(
                self.server,
                args.host,
                args.port,
                server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
            )
        except OSError:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
            raise
        self.port = port
        self.servicer = add_generation_servicer(self.server, engine)
        # The SGLang model gateway's worker protocol, on the same port.
        self.sglang = sglang_service.add_sglang_scheduler_servicer(
            self.server, engine, served_model_name=getattr(args, "served_model_name", None)
        )
        self.servicer.max_id_bytes = self.sglang.max_id_bytes = args.max_id_bytes
        self._add_health_and_reflection()
        await self.server.start()
        await self._set_health(engine.healthy)
        self.sglang.ready = True
        # Tests and scripts wait for this line (the port may have been picked by the OS).
        print(f"tokenbudget server listening on {args.host}:{port}", flush=True)

    async def drain(self) -> None:
        """Refuse new requests; wait up to --drain-timeout for those in flight."""
        engine, loop = self.engine, asyncio.get_running_loop()
        logger.info(
            "draining: refusing new requests, waiting up to %.0fs for %d in flight",
            self.args.drain_timeout,
            engine.num_requests,
        )
        self.servicer.draining.set()
        self.sglang.draining = True
        await self._set_health(False)
        # Blocking waits run off the loop, which keeps streaming the requests in flight.
        if not await loop.run_in_executor(None, engine.wait_idle, self.args.drain_timeout):
            logger.warning("drain timeout: aborting %d requests", engine.num_requests)
        # What the drain left, for operators (and tests): all zeros unless it timed out.
        try:
            s = await loop.run_in_executor(None, engine.get_stats, 2.0)
            logger.info(
                "drained: %d requests running, %d waiting, %d of %d KV blocks in use",
                s.num_running,
                s.num_waiting,
                s.num_total_blocks - s.num_free_blocks,
                s.num_total_blocks,
            )
        except Exception as exc:  # an engine that died or hangs has no stats to give
            logger.warning("drained; the engine gave no stats: %s", exc)

    async def stop(self) -> None:
        """Shut the engine down, then the server; write the trace if one was kept."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        await self.server.stop(grace=2)
        recorder = self.engine.trace_recorder
        if recorder is not None:
            recorder.save(self.args.record_trace)
            logger.info(
                "trace of %d requests written to %s", len(recorder.requests), self.args.record_trace
            )
        logger.info("stopped")

    def _interceptors(self) -> list:
        from tokenbudget.server.entrypoints.grpc import sglang as sglang_service
        from tokenbudget.server.entrypoints.grpc.generation import SERVICE_NAME
        from tokenbudget.server.entrypoints.grpc.limits import GenerationLimitInterceptor
        from tokenbudget.server.entrypoints.grpc.security import ApiKeyInterceptor

        # The key is checked first: a call without it must not take a generation slot.
        interceptors = [ApiKeyInterceptor(self.args.api_key)] if self.args.api_key else []
        interceptors.append(
            GenerationLimitInterceptor(
                self.args.max_concurrent_rpcs,
                (
                    f"/{SERVICE_NAME}/Generate",
                    f"/{SERVICE_NAME}/Embed",
                    f"/{sglang_service.SERVICE_NAME}/Generate",
                ),
            )
        )
        return interceptors

    def _add_health_and_reflection(self) -> None:
        """Health, turned NOT_SERVING while the engine is dead, and reflection."""
        from grpc_health.v1 import health, health_pb2_grpc

        from tokenbudget.server.entrypoints.grpc import sglang as sglang_service
        from tokenbudget.server.entrypoints.grpc.generation import SERVICE_NAME

        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # The worker's control plane (Initialize, Shutdown) is not served here and
        # must not be advertised on the public port.
        _enable_reflection(
            self.server, (SERVICE_NAME, sglang_service.SERVICE_NAME, health.SERVICE_NAME)
        )
        loop = asyncio.get_running_loop()

        def on_health(serving: bool) -> None:  # called on the engine thread
            if serving and self.servicer.draining.is_set():
                return
            try:
                asyncio.run_coroutine_threadsafe(self._set_health(serving), loop)
            except RuntimeError:  # the loop is closed: the server is gone anyway
                pass

        self.engine.on_death(lambda exc: on_health(False))
        self.engine.on_recovery(lambda: on_health(True))

    async def _set_health(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        from tokenbudget.server.entrypoints.grpc import sglang as sglang_service
        from tokenbudget.server.entrypoints.grpc.generation import SERVICE_NAME

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        async with self._health_lock:
            for name in ("", SERVICE_NAME, sglang_service.SERVICE_NAME):
                await self.health.set(name, status)


def _enable_reflection(server, service_names: tuple[str, ...]) -> None:
    """Server reflection (on a grpc.aio server) under both names clients ask
    for: grpc.reflection.v1 (grpcurl, current gRPC libraries) and v1alpha
    (older ones). grpcio-reflection implements only v1alpha; v1's messages are
    the same on the wire (same fields and numbers, another package), so one
    servicer answers under both names."""
    import grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    names = (reflection.SERVICE_NAME, _REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer((*service_names, *names))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        tuple(
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
            for name in names
        )
    )
