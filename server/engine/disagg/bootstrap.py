"""The prefill's bootstrap listener (gRPC ``tokenbudget.v1.KVBootstrap``,
proto/kv_bootstrap.proto) and the decode's client of it.

The listener is a thread-pool gRPC server, not an asyncio one: its handlers
block on per-registration events and must stay out of the engine's and the
entry point's event loops. Each handler hands a ``Registration`` to a
``RegistrationSink`` (the PrefillConnector) and streams back the one reply
the sink gives it. With the worker secret set, every call must present it
(``authorization: Bearer <secret>``): a registration makes the prefill
write a request's KV to whoever sent it."""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from array import array
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from tokenbudget.proto import kv_bootstrap_pb2 as pb
from tokenbudget.proto import kv_bootstrap_pb2_grpc as pb_grpc
from tokenbudget.proto.rpc.auth import bearer_metadata, is_loopback, presents, refusing_handler
from tokenbudget.proto.rpc.ports import NO_PORT_REUSE, bind_port

logger = logging.getLogger("tokenbudget.server")

# Size limits of a RegisterRequest (refused with INVALID_ARGUMENT, naming the field).
MAX_RANKS = 64
MAX_HANDSHAKE_BYTES = 4 << 20
MAX_BLOCKS = 1 << 20
MAX_REQUEST_ID_BYTES = 1024
MAX_BLOCK_SIZE = 1 << 16
DIGEST_BYTES = 32
MAX_MESSAGE_BYTES = 64 << 20
# Registration streams served at once (each waits on a thread for its KV
# send); more are refused with RESOURCE_EXHAUSTED rather than queued.
MAX_STREAMS = 512
# How often a waiting handler looks at its deadline and its stream.
POLL_S = 0.2
# The decode's channels retry a lost prefill at most this often: gRPC's own
# backoff grows to 120 s, and a channel in it fails every call at once, so a
# prefill restarted on its port stayed unreachable for its decode that long.
RECONNECT_BACKOFF_MS = 500


def address(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def prompt_digest(token_ids: list[int]) -> bytes:
    """SHA-256 of the token ids as little-endian int64s: a prefill and a
    decode that tokenized the prompt differently must not pair up."""
    ids = array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).digest()


@dataclass(slots=True, eq=False)
class Registration:
    """A decode's Register call: where to write room's KV. ``answer`` is
    called once by whoever settles it (later calls are ignored); the
    handler streams that reply."""

    room: int
    request_id: str
    handshakes: list[bytes]
    skip_tokens: int
    dst_block_ids: list[int]
    num_prompt_tokens: int
    block_size: int
    prompt_digest: bytes
    arrived: float = field(default_factory=time.monotonic)
    reply: pb.RegisterReply | None = None
    answered: threading.Event = field(default_factory=threading.Event)

    def answer(self, reply: pb.RegisterReply) -> bool:
        """Settle with ``reply``; False when already settled. Callers hold the sink's lock."""
        if self.answered.is_set():
            return False
        self.reply = reply
        self.answered.set()
        return True


def done_reply(first_token_id: int, num_blocks_sent: int) -> pb.RegisterReply:
    return pb.RegisterReply(
        done=pb.RegisterReply.Done(first_token_id=first_token_id, num_blocks_sent=num_blocks_sent)
    )


def error_reply(message: str) -> pb.RegisterReply:
    return pb.RegisterReply(error=pb.RegisterReply.Error(message=message))


class RegistrationSink(Protocol):
    """What the listener needs from the prefill's connector (thread-safe)."""

    timeout: float

    def register(self, reg: Registration) -> None:
        """A registration arrived (the sink may answer it at once)."""

    def expire(self, reg: Registration) -> None:
        """``reg`` waited ``timeout`` seconds: answer it with an error unless
        a request for its room arrived."""

    def stream_closed(self, reg: Registration) -> None:
        """``reg``'s call ended (answered, or cancelled by the decode)."""

    def cancel_room(self, room: int) -> threading.Event:
        """Stop writing into room's blocks; the event is set once nothing writes."""


def check_register_request(request: pb.RegisterRequest) -> str | None:
    """Why ``request`` is malformed or over the limits (naming the field), or None."""
    if not request.request_id or len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        return f"request_id must be 1..{MAX_REQUEST_ID_BYTES} bytes"
    if not 1 <= len(request.handshakes) <= MAX_RANKS:
        return f"handshakes must hold 1..{MAX_RANKS} entries (one per TP rank), got " + str(
            len(request.handshakes)
        )
    for rank, handshake in enumerate(request.handshakes):
        if not 0 < len(handshake) <= MAX_HANDSHAKE_BYTES:
            return (
                f"handshakes[{rank}] must be 1..{MAX_HANDSHAKE_BYTES} bytes, got {len(handshake)}"
            )
    if len(request.dst_block_ids) > MAX_BLOCKS:
        return f"dst_block_ids holds {len(request.dst_block_ids)} ids, more than {MAX_BLOCKS}"
    if any(b < 0 for b in request.dst_block_ids):
        return "dst_block_ids must be >= 0"
    if not 1 <= request.block_size <= MAX_BLOCK_SIZE:
        return f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {request.block_size}"
    if len(request.prompt_digest) != DIGEST_BYTES:
        return f"prompt_digest must be {DIGEST_BYTES} bytes, got {len(request.prompt_digest)}"
    if request.num_prompt_tokens < 1:
        return f"num_prompt_tokens must be >= 1, got {request.num_prompt_tokens}"
    if not 0 <= request.skip_tokens <= request.num_prompt_tokens:
        return (
            f"skip_tokens must be in 0..num_prompt_tokens ({request.num_prompt_tokens}), "
            f"got {request.skip_tokens}"
        )
    return None


class BootstrapServicer(pb_grpc.KVBootstrapServicer):
    def __init__(self, sink: RegistrationSink) -> None:
        self._sink = sink

    def Register(self, request, context):  # noqa: N802 (gRPC's name)
        problem = check_register_request(request)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        reg = Registration(
            room=request.room,
            request_id=request.request_id,
            handshakes=list(request.handshakes),
            skip_tokens=request.skip_tokens,
            dst_block_ids=list(request.dst_block_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            block_size=request.block_size,
            prompt_digest=request.prompt_digest,
        )
        self._sink.register(reg)
        if not context.add_callback(lambda: self._sink.stream_closed(reg)):
            self._sink.stream_closed(reg)  # the call already ended
            return
        deadline = reg.arrived + self._sink.timeout
        while context.is_active():
            if reg.answered.wait(POLL_S):
                yield reg.reply
                return
            if time.monotonic() >= deadline:
                self._sink.expire(reg)

    def Cancel(self, request, context):  # noqa: N802 (gRPC's name)
        quiet = self._sink.cancel_room(request.room)
        remaining = context.time_remaining()  # None or huge without a client deadline
        limit = self._sink.timeout if remaining is None else min(remaining, self._sink.timeout)
        if not quiet.wait(max(limit, 0.0)):
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the KV send of room {request.room} is still in flight",
            )
        return pb.CancelReply()


class BootstrapSecretInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED and before reading the message, calls
    that do not present the worker secret."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or presents(handler_call_details.invocation_metadata, self._secret):
            return handler

        def deny(request_iterator, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this prefill's bootstrap listener requires the secret of its "
                "--worker-secret-file: give the decode server the same file",
            )

        return refusing_handler(deny)


class BootstrapServer:
    """KVBootstrap served for ``sink`` on host:port (0: a free port; ``port``
    is the bound one), started at once. Raises BindError for a taken port."""

    def __init__(self, sink: RegistrationSink, host: str, port: int, secret: str | None) -> None:
        self._pool = futures.ThreadPoolExecutor(MAX_STREAMS, thread_name_prefix="kv-bootstrap")
        self._server = grpc.server(
            self._pool,
            interceptors=[BootstrapSecretInterceptor(secret)] if secret else [],
            options=[NO_PORT_REUSE, ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
            maximum_concurrent_rpcs=MAX_STREAMS,
        )
        pb_grpc.add_KVBootstrapServicer_to_server(BootstrapServicer(sink), self._server)
        self.port = bind_port(self._server, host, port)
        self._server.start()
        if not secret and not is_loopback(host):
            logger.warning(
                "the KV bootstrap listener on %s has no secret: anyone who can reach it and "
                "guess a room can read that request's KV; give --worker-secret-file",
                address(host, self.port),
            )

    def stop(self) -> None:
        """Stop listening; open calls end (their handlers see the context end)."""
        self._server.stop(grace=0).wait()
        self._pool.shutdown(wait=False)


class BootstrapClient:
    """The decode's channels to prefill bootstrap listeners, one per address,
    kept open (thread-safe)."""

    def __init__(self, secret: str | None) -> None:
        self.metadata = bearer_metadata(secret)
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int], tuple[grpc.Channel, pb_grpc.KVBootstrapStub]] = {}

    def stub(self, host: str, port: int) -> pb_grpc.KVBootstrapStub:
        with self._lock:
            entry = self._channels.get((host, port))
            if entry is None:
                channel = grpc.insecure_channel(
                    address(host, port),
                    options=[
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
                        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
                        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
                    ],
                )
                entry = (channel, pb_grpc.KVBootstrapStub(channel))
                self._channels[(host, port)] = entry
            return entry[1]

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel, _ in channels:
            channel.close()
