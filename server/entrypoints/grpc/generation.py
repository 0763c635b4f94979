"""The Generation gRPC service over an AsyncEngine.

Every bad input is answered with INVALID_ARGUMENT and a message naming the
field; the engine never sees it. Refusals follow server/entrypoints/grpc/errors.py:
no paths in messages, a status set and a return rather than ``abort``.
``add_generation_servicer(server, engine)`` lets any grpc.Server (thread pool)
or grpc.aio server host the service; the ``server`` CLI uses grpc.aio, which
streams tokens at about half the CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import uuid

import grpc

from tokenbudget.core.failures import RequestFailedError, UnsupportedRequestError
from tokenbudget.core.request import Request
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.core.failures import DuplicateRequestError, QueueFullError
from tokenbudget.core.structured.manager import GrammarTimeoutError
from tokenbudget.proto import common_pb2, convert, generate_pb2, generate_pb2_grpc
from tokenbudget.server.engine.async_engine import AsyncEngine, EngineDeadError
from tokenbudget.server.engine.streams import RequestStream
from tokenbudget.server.entrypoints.grpc.admission import Admission, admit
from tokenbudget.server.entrypoints.grpc.errors import add_servicer, public_message, refuse
from tokenbudget.server.entrypoints.grpc.generation_replies import Replies, embed_response
from tokenbudget.server.entrypoints.grpc.limits import refused_bytes
from tokenbudget.server.entrypoints.grpc.lora_rpcs import AioLoRARPCs, LoRARPCs
from tokenbudget.server.engine.request_builder import build_pooling_request, make_requests
from tokenbudget.server.engine.client_strings import (
    DEFAULT_MAX_ID_BYTES,
    check_client_strings,
    quoted,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


# Engine errors as gRPC statuses, most specific first (the first two are ValueErrors).
_STATUS_OF_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # also checked on the engine thread
    (GrammarTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # also after queueing: a failed grammar
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    # The workers cannot serve this kind of request at all (not a transient state).
    (UnsupportedRequestError, grpc.StatusCode.UNIMPLEMENTED),
    # One request failed inside the engine; the others went on.
    (RequestFailedError, grpc.StatusCode.INTERNAL),
)
_SERVED_ERRORS = tuple(t for t, _ in _STATUS_OF_ERROR)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a client gets for an engine error."""
    return next(code for t, code in _STATUS_OF_ERROR if isinstance(exc, t)), public_message(exc)


class GenerationServicer(LoRARPCs, generate_pb2_grpc.GenerationServicer):
    """For a thread-pool grpc.Server: one handler thread per live stream."""

    # The longest request_id, tenant and cache_salt (the server's --max-id-bytes).
    max_id_bytes = DEFAULT_MAX_ID_BYTES

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Set while draining (SIGTERM): new requests get UNAVAILABLE.
        self.draining = threading.Event()

    # -- Generate ---------------------------------------------------------------------
    def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        try:
            req, stream = self._submit(request)
        except _SERVED_ERRORS as exc:
            refuse(context, *_status_of(exc))
            refused_bytes.add(request.ByteSize())
            return
        rid = stream.request_id
        # A client that cancels or disconnects frees its KV within one step;
        # one that left while its request was prepared gets no callback.
        if not context.add_callback(lambda: self.engine.abort(rid)):
            self.engine.abort(rid)
            return
        reply = Replies(req, rid)
        try:
            for chunk in stream:
                yield reply.message(chunk)
        except _SERVED_ERRORS as exc:
            refuse(context, *_status_of(exc))

    def _submit(
        self, request: generate_pb2.GenerateRequest, admission: Admission | None = None
    ) -> tuple[Request, RequestStream]:
        """Returns the first sample's Request (they share the prompt) and the
        stream; with an ``admission``, only while its client is there."""
        if self.draining.is_set():
            raise EngineDeadError("the server is shutting down")
        rid, requests = self._make_requests(request)
        add = self.engine.add_request if admission is None else admission.add_request
        return requests[0], add(requests, request_id=rid)

    def _make_requests(self, request: generate_pb2.GenerateRequest) -> tuple[str, list[Request]]:
        rid = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        if not rid:
            raise ValueError("request_id must not be empty (leave it unset to get one)")
        sp = request.sampling_params
        try:  # counts first: 100k strings are not worth making into Python objects
            self.engine.input_processor.request_limits.check_counts(
                len(sp.stop), len(sp.bad_words), len(sp.bad_words_token_ids)
            )
            params = convert.sampling_params_from_proto(sp, self.engine.sampling_defaults)
        except ValueError as exc:
            raise ValueError(f"sampling_params.{exc}") from None
        prompt = self._prompt(request)
        # Optional fields: unset is None (the scheduler's "not given").
        options = {
            name: getattr(request, name)
            for name in _OPTIONAL_REQUEST_FIELDS
            if request.HasField(name)
        }
        check_client_strings(rid, options, self.max_id_bytes)
        if request.HasField("lora_name"):
            options["lora_request"] = self._lora_request(request.lora_name)
        return rid, make_requests(
            self.engine, rid, prompt, params, priority=request.priority, **options
        )

    def _prompt(self, request: generate_pb2.GenerateRequest) -> dict:
        """The InputProcessor's prompt form for the request's input oneof."""
        kind = request.WhichOneof("input")
        images = list(request.images)
        if images or kind == "chat":
            if not self.engine.is_vision_language and (images or _chat_has_images(request)):
                raise ValueError(f"images: model {self.engine.model_name} does not accept images")
        if kind is None:
            raise ValueError("input: set one of text, token_ids or chat")
        if kind == "text":
            if not request.text:
                raise ValueError("text: the prompt must not be empty")
            return {"prompt": request.text, "images": images}
        if kind == "token_ids":
            num_ids = len(request.token_ids.ids)
            if not num_ids:
                raise ValueError("token_ids: the prompt must not be empty")
            limit = self.engine.max_model_len
            if num_ids > limit and not request.sampling_params.HasField("truncate_prompt_tokens"):
                # Before the ids become Python ints (36 bytes each).
                raise ValueError(
                    f"token_ids: the prompt has {num_ids} tokens, more than max_model_len={limit}"
                )
            if images:
                return {"prompt": list(request.token_ids.ids), "images": images}
            return {"prompt_token_ids": list(request.token_ids.ids)}
        if images:
            raise ValueError("images: put a chat's images in its messages' content parts")
        if not request.chat.messages:
            raise ValueError("chat.messages must not be empty")
        return {"messages": [_message(i, m) for i, m in enumerate(request.chat.messages)]}

    # -- Embed ------------------------------------------------------------------------
    def Embed(self, request: generate_pb2.EmbedRequest, context: grpc.ServicerContext):
        try:
            req, stream = self._submit_embed(request)
        except _SERVED_ERRORS as exc:
            refuse(context, *_status_of(exc))
            refused_bytes.add(request.ByteSize())
            return None
        rid = stream.request_id
        context.add_callback(lambda: self.engine.abort(rid))
        try:
            chunks = list(stream)
        except _SERVED_ERRORS as exc:
            refuse(context, *_status_of(exc))
            return None
        reply = embed_response(req, rid, chunks[-1] if chunks else None)
        if reply is None:
            refuse(context, grpc.StatusCode.ABORTED, _aborted(rid))
        return reply

    def _submit_embed(
        self, request: generate_pb2.EmbedRequest, admission: Admission | None = None
    ) -> tuple[Request, RequestStream]:
        if self.draining.is_set():
            raise EngineDeadError("the server is shutting down")
        rid = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        if not rid:
            raise ValueError("request_id must not be empty (leave it unset to get one)")
        kind = request.WhichOneof("input")
        if kind is None:
            raise ValueError("input: set one of text or token_ids")
        if kind == "text" and not request.text:
            raise ValueError("text: the prompt must not be empty")
        if kind == "token_ids" and not request.token_ids.ids:
            raise ValueError("token_ids: the prompt must not be empty")
        prompt = (
            {"prompt": request.text}
            if kind == "text"
            else {"prompt_token_ids": list(request.token_ids.ids)}
        )
        params = None
        if request.HasField("pooling_params"):
            try:
                params = convert.pooling_params_from_proto(request.pooling_params)
            except ValueError as exc:
                raise ValueError(f"pooling_params.{exc}") from None
        options = {
            name: getattr(request, name)
            for name in ("cache_salt", "tenant")
            if request.HasField(name)
        }
        check_client_strings(rid, options, self.max_id_bytes)
        req = build_pooling_request(
            self.engine.input_processor,
            rid,
            prompt,
            params,
            self.engine.pooler_config,
            priority=request.priority,
            **options,
        )
        add = self.engine.add_request if admission is None else admission.add_request
        return req, add(req, request_id=rid, detokenize=False)

    # -- the other RPCs -------------------------------------------------------------------
    def Abort(self, request: generate_pb2.AbortRequest, context: grpc.ServicerContext):
        if not self.engine.abort(request.request_id):
            refuse(context, grpc.StatusCode.NOT_FOUND, _not_live(request.request_id))
        return generate_pb2.AbortResponse()

    def GetModelInfo(self, request, context):
        return self._model_info()

    def GetStats(self, request, context):
        try:
            s = self.engine.get_stats()
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, _NO_STATS)
        return generate_pb2.Stats(**dataclasses.asdict(s))

    def SubscribeKvEvents(self, request, context):
        sub, why = self._kv_subscription(request)
        if sub is None:
            context.abort(*why)
        try:
            while context.is_active():
                batch = sub.get(timeout=0.25)
                if batch is not None:
                    yield convert.kv_event_batch_to_proto(batch)
        finally:
            sub.close()

    def _kv_subscription(self, request: generate_pb2.SubscribeKvEventsRequest):
        """(subscription, None) or (None, (status, why))."""
        if request.max_pending < 0:
            return None, (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_pending must be >= 0, got {request.max_pending}",
            )
        sub = self.engine.subscribe_kv_events(request.max_pending or _KV_EVENTS_MAX_PENDING)
        if sub is None:
            return None, (
                grpc.StatusCode.FAILED_PRECONDITION,
                "KV cache events are off: start the server with --enable-kv-cache-events",
            )
        return sub, None

    def _model_info(self) -> generate_pb2.ModelInfo:
        e = self.engine
        sched, cache = e.scheduler_config, e.cache_config
        return generate_pb2.ModelInfo(
            model=e.served_model_name,
            vocab_size=e.input_processor.vocab_size,
            max_model_len=sched.max_model_len,
            block_size=cache.block_size,
            num_blocks=cache.num_blocks,
            is_vision_language=e.is_vision_language,
            is_demo=e.is_demo,
            eos_token_ids=e.eos_token_ids,
            async_scheduling=sched.async_scheduling,
            policy=sched.policy,
            num_workers=e.num_remote_workers,
            lora_adapters=self._lora_adapters(),
        )


class AioGenerationServicer(AioLoRARPCs, GenerationServicer):
    """For a grpc.aio server: every stream is a coroutine on one event loop.

    A thread per stream costs two thread wake-ups and a condition variable
    round trip per message; on the event loop a message costs about half
    the CPU, and the engine wakes all readers of a step with one call."""

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        try:  # off the loop: tokenizing a long prompt or an image takes milliseconds
            req, stream = await admit(self.engine, lambda a: self._submit(request, a))
        except _SERVED_ERRORS as exc:
            refuse(context, *_status_of(exc))
            refused_bytes.add(request.ByteSize())
            return
        reply = Replies(req, stream.request_id)
        failed = False
        try:
            async for chunk in stream:
                await context.write(reply.message(chunk))
        except _SERVED_ERRORS as exc:
            failed = True
            refuse(context, *_status_of(exc))
        finally:
            if not (failed or stream.finished):  # the client cancelled or went away
                self.engine.abort(stream.request_id)  # free its KV

    async def Embed(self, request: generate_pb2.EmbedRequest, context: grpc.aio.ServicerContext):
        try:
            req, stream = await admit(self.engine, lambda a: self._submit_embed(request, a))
        except _SERVED_ERRORS as exc:
            refuse(context, *_status_of(exc))
            refused_bytes.add(request.ByteSize())
            return None
        last = None
        failed = False
        try:
            async for chunk in stream:
                last = chunk
        except _SERVED_ERRORS as exc:
            failed = True
            refuse(context, *_status_of(exc))
            return None
        finally:
            if not (failed or stream.finished):  # the client cancelled or went away
                self.engine.abort(stream.request_id)
        reply = embed_response(req, stream.request_id, last)
        if reply is None:
            refuse(context, grpc.StatusCode.ABORTED, _aborted(stream.request_id))
        return reply

    async def Abort(self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        if not self.engine.abort(request.request_id):
            refuse(context, grpc.StatusCode.NOT_FOUND, _not_live(request.request_id))
        return generate_pb2.AbortResponse()

    async def GetModelInfo(self, request, context):
        return self._model_info()

    async def SubscribeKvEvents(self, request, context):
        sub, why = self._kv_subscription(request)
        if sub is None:
            await context.abort(*why)
        try:
            while True:
                # Polled: a blocking get would hold an executor thread per subscriber.
                batch = sub.get(timeout=0)
                if batch is None:
                    await asyncio.sleep(0.02)
                else:
                    await context.write(convert.kv_event_batch_to_proto(batch))
        finally:
            sub.close()

    async def GetStats(self, request, context):
        try:  # the engine thread answers between steps; the loop keeps serving meanwhile
            s = await asyncio.get_running_loop().run_in_executor(None, self.engine.get_stats)
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _NO_STATS)
        return generate_pb2.Stats(**dataclasses.asdict(s))


_NO_STATS = "the engine did not answer in time"
# Batches a KV event subscriber may fall behind by before it gets a snapshot instead.
_KV_EVENTS_MAX_PENDING = 1024


# GenerateRequest's optional fields that are Request keywords of the same name.
_OPTIONAL_REQUEST_FIELDS = ("cache_salt", "tenant", "ttft_ms", "tpot_ms")


def _aborted(request_id: str) -> str:
    return f"request_id {quoted(request_id)} was aborted before its embedding was computed"


def _not_live(request_id: str) -> str:
    return f"request_id {quoted(request_id)} is not a live request"


def _chat_has_images(request: generate_pb2.GenerateRequest) -> bool:
    return any(p.WhichOneof("part") == "image" for m in request.chat.messages for p in m.content)


def _message(i: int, m: generate_pb2.ChatMessage) -> dict:
    if not m.role:
        raise ValueError(f"chat.messages[{i}].role must not be empty")
    parts = []
    for j, p in enumerate(m.content):
        kind = p.WhichOneof("part")
        if kind is None:
            raise ValueError(f"chat.messages[{i}].content[{j}]: set text or image")
        parts.append(
            {"type": "text", "text": p.text}
            if kind == "text"
            else {"type": "image", "image": p.image}
        )
    if all(p["type"] == "text" for p in parts):
        return {"role": m.role, "content": "".join(p["text"] for p in parts)}
    return {"role": m.role, "content": parts}


def add_generation_servicer(
    server: grpc.Server | grpc.aio.Server, engine: AsyncEngine
) -> GenerationServicer:
    """Host the Generation service of ``engine`` on ``server`` (not started):
    a thread-pool grpc.Server or a grpc.aio server (cheaper per streamed token)."""
    servicer = (
        AioGenerationServicer(engine)
        if isinstance(server, grpc.aio.Server)
        else GenerationServicer(engine)
    )
    add_servicer(generate_pb2_grpc.add_GenerationServicer_to_server, servicer, server)
    return servicer


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """For clients: a SamplingParams as its message."""
    msg = common_pb2.SamplingParams()
    convert.sampling_params_to_proto(params, msg)
    return msg
