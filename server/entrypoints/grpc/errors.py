"""What a gRPC client is told when its request cannot be served.

Three rules every service on the public port follows:

* A request message that does not parse (corrupt bytes, a string field that
  is not UTF-8) is answered INVALID_ARGUMENT naming the field where it can be
  found, never grpc's UNKNOWN with a Python class name. ``add_servicer``
  registers a generated ``add_XServicer_to_server`` with deserializers that
  return an ``Undecodable`` instead of raising, and handlers that refuse it.
* Messages never carry internal file paths or tracebacks (``public_message``):
  a remote worker's or a library's error text is cut to what it says.
* A refusal ends the call with ``set_code``/``set_details`` and a return,
  not ``context.abort``: abort raises, and grpc keeps that exception, its
  traceback and the frames holding the request message in a reference cycle
  that only a full collection frees; with the engine's raised collection
  threshold (core/utils/gc_policy.py) that took the server from 0.9 GB to 3.4 GB
  over 40 refused 2 MB prompts.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

logger = logging.getLogger(__name__)

INTERNAL_ERROR = "internal error while serving the request; the server's log has the details"
# Longest status message sent; a longer one is cut (a worker's error can be a page).
_MAX_MESSAGE_CHARS = 2000
_SOURCE_PATH = re.compile(
    r"(?:[A-Za-z]:)?(?:[/\\][\w.+@~-]+)*[/\\]([\w.+@-]+\.(?:py|pyx|pxi|pxd|cc|cpp|cxx|c|h|hpp|"
    r"cu|cuh|so))\b"
)
_TRACEBACK_FRAME = re.compile(r'^\s*File "[^"]*", line \d+.*$\n?(?:^\s{4,}\S.*$\n?)*', re.M)


def public_message(exc: BaseException | str) -> str:
    """An error's text as a client may see it: no traceback (the line that
    names the error is kept), no file paths (their file names are), at most
    2000 characters."""
    text = str(exc)
    head, sep, tail = text.partition("Traceback (most recent call last):")
    if sep:
        last = [line for line in _TRACEBACK_FRAME.sub("", tail).splitlines() if line.strip()]
        text = " ".join(s for s in (head.strip(), last[-1].strip() if last else "") if s)
    text = _SOURCE_PATH.sub(r"\1", text)
    if len(text) > _MAX_MESSAGE_CHARS:
        text = text[: _MAX_MESSAGE_CHARS - 3] + "..."
    return text


def refuse(
    context: grpc.ServicerContext | grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> None:
    """Set the call's status; the handler then returns (see the module's
    docstring for why this is not ``context.abort``)."""
    context.set_code(code)
    context.set_details(message)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request message that did not parse, and why (for the client)."""

    message: str


def undecodable(descriptor: Descriptor, data: bytes) -> Undecodable:
    field = _field_with_bad_utf8(descriptor, data, "")
    if field is not None:
        return Undecodable(f"{field}: not valid UTF-8 (string fields must hold UTF-8 text)")
    return Undecodable(
        f"the request is not a valid {descriptor.full_name} message (its bytes "
        "do not parse as protobuf)"
    )


def add_servicer(
    add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.Server | grpc.aio.Server
) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_XServicer_to_server``),
    with every method refusing undecodable requests with INVALID_ARGUMENT;
    on a grpc.aio server an unexpected exception is logged and answered
    INTERNAL without its text (which can hold paths)."""
    captured = _Captured()
    add_to_server(servicer, captured)
    is_aio = isinstance(server, grpc.aio.Server)
    handlers = {name: _guarded(h, is_aio) for name, h in captured.handlers.items()}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(captured.service, handlers),)
    )
    server.add_registered_method_handlers(captured.service, handlers)


class _Captured:
    """Stands in for the server while a generated add function registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers come again by name below

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self.service, self.handlers = service, dict(handlers)


def _guarded(handler: grpc.RpcMethodHandler, is_aio: bool) -> grpc.RpcMethodHandler:
    if handler.request_streaming:
        return handler  # none of ours; a stream's messages are parsed as they come
    parse = handler.request_deserializer
    descriptor = parse.__self__.DESCRIPTOR  # parse is the request class's FromString

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError:
            return undecodable(descriptor, data)

    serialize = handler.response_serializer
    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    behavior = getattr(handler, kind)
    wrap = _aio_behavior if is_aio else _sync_behavior
    return handler._replace(
        request_deserializer=deserialize,
        # A refused unary call returns None; its status is what the client gets.
        response_serializer=lambda message: b"" if message is None else serialize(message),
        **{kind: wrap(behavior)},
    )


def _sync_behavior(behavior: Callable) -> Callable:
    def call(request, context):
        if isinstance(request, Undecodable):
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return iter(()) if inspect.isgeneratorfunction(behavior) else None
        return behavior(request, context)

    return call


def _aio_behavior(behavior: Callable) -> Callable:
    # grpc.aio tells a streaming handler that yields from one that writes by
    # its function's kind, so the wrapper keeps the kind of what it wraps.
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            if isinstance(request, Undecodable):
                refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return
            try:
                async for message in behavior(request, context):
                    yield message
            except Exception as exc:  # noqa: BLE001 - the client gets a status, the log the rest
                _internal(context, exc)

        return stream

    async def call(request, context):
        if isinstance(request, Undecodable):
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return None
        try:
            return await behavior(request, context)
        except Exception as exc:  # noqa: BLE001
            _internal(context, exc)
            return None

    return call


def _internal(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # the handler chose its status
    logger.exception("unexpected error serving a request")
    refuse(context, grpc.StatusCode.INTERNAL, INTERNAL_ERROR)


# -- finding the string field that is not UTF-8 ----------------------------------------


def _field_with_bad_utf8(descriptor: Descriptor, data: bytes, prefix: str) -> str | None:
    """The path (``chat.messages[0].content[1].text``) of the first string
    field in ``data`` that is not UTF-8, or None (also for bytes that are
    not protobuf at all)."""
    seen: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + size], pos + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.is_repeated and not _is_map(field):
                    name += f"[{seen.get(number, 0)}]"
                    seen[number] = seen.get(number, 0) + 1
                if field.type == FieldDescriptor.TYPE_STRING:
                    chunk.decode("utf-8")
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = _field_with_bad_utf8(field.message_type, chunk, name + ".")
                    if found is not None:
                        return found
            else:
                return None
    except UnicodeDecodeError:
        return name
    except IndexError:
        return None
    return None


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
