"""Bearer tokens on gRPC calls: the worker's shared secret, and the helpers
the server's API key (server/entrypoints/grpc/security.py) reuses.

A worker runs whatever model path Initialize names and stops on Shutdown, so
anyone who can reach its port owns the server's engine. Workers therefore
listen on loopback by default, and ``--worker-secret-file PATH`` (the same
file on the server and every worker) makes each call carry
``authorization: Bearer <secret>``; a call without it is refused with
UNAUTHENTICATED. A worker bound to another address without a secret refuses
to start unless ``--allow-unauthenticated`` says the network is trusted.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from pathlib import Path

import grpc

AUTHORIZATION = "authorization"


def read_secret_file(path: str, what: str = "--worker-secret-file") -> str:
    """The secret in ``path`` (surrounding whitespace stripped); ValueError
    naming ``what`` when it cannot be read or is empty."""
    try:
        secret = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{what}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if not secret:
        raise ValueError(f"{what}: {path} is empty")
    return secret


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents ``token`` (none without one)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def presents(metadata, token: str) -> bool:
    """Whether call metadata carries ``authorization: Bearer <token>``
    (compared in constant time)."""
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            given = value.encode() if isinstance(value, str) else value
            if hmac.compare_digest(given, expected):
                return True
    return False


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; any other name or address is not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def handler_with_behavior(
    handler: grpc.RpcMethodHandler, behavior: Callable
) -> grpc.RpcMethodHandler:
    """A method handler of ``handler``'s kind (unary or streaming each way)
    and (de)serializers that runs ``behavior`` instead."""
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def refusing_handler(behavior: Callable) -> grpc.RpcMethodHandler:
    """A handler that runs ``behavior(request_iterator, context)`` without
    reading the request: a refusal decided on metadata alone never receives,
    buffers or parses the message (whatever its size). Every call kind looks
    the same on the wire, so a streaming handler answers unary calls too."""
    return grpc.stream_stream_rpc_method_handler(behavior)


class WorkerSecretInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that does not present the secret."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or presents(handler_call_details.invocation_metadata, self._secret):
            return handler

        def deny(request_iterator, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this worker requires the shared secret of --worker-secret-file "
                "(metadata 'authorization: Bearer <secret>')",
            )

        return refusing_handler(deny)
