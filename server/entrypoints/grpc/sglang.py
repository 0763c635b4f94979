"""The SGLang model gateway's worker protocol over an AsyncEngine.

``sglang.grpc.scheduler.SglangScheduler`` is what the gateway (PyPI
``sglang-router``) speaks to its gRPC workers: it tokenizes and applies chat
templates itself, sends token ids, and turns our token ids back into OpenAI
HTTP. Requests run through the same engine path as tokenbudget.v1.Generation
(``request_builder.make_requests``), so the engine enforces max_tokens, stop
strings and EOS, and an Abort frees the KV before the next step. The
messages' translation lives in sglang_convert.py.

Disaggregated prefill/decode (the gateway's ``--pd-disaggregation``): on a
prefill or decode server each sample of a Generate gets its part
(``KVTransferParams``, sglang_convert.py) and the response headers go out at
once; a failed transfer ends the request with an in-band error.

Errors: a bad request is answered in-band (``GenerateError`` naming the
field, with an HTTP status the gateway passes on): a gRPC error status makes
the gateway retry the request 5 times and count each try against the
replica's circuit breaker. Only a replica that cannot serve at all (draining,
engine dead) answers with a status (UNAVAILABLE), so the gateway goes
elsewhere.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
from collections.abc import AsyncIterator
from importlib import metadata

import grpc

from tokenbudget.core.failures import RequestFailedError, UnsupportedRequestError
from tokenbudget.core.failures import DuplicateRequestError, QueueFullError
from tokenbudget.core.structured.manager import GrammarTimeoutError
from tokenbudget.proto import sglang_scheduler_pb2 as pb
from tokenbudget.proto import sglang_scheduler_pb2_grpc as pb_grpc
from tokenbudget.server.engine.async_engine import AsyncEngine, EngineDeadError
from tokenbudget.server.engine.streams import RequestStream
from tokenbudget.core.request import Request
from tokenbudget.server.entrypoints.grpc.admission import Admission, admit
from tokenbudget.server.entrypoints.grpc.errors import add_servicer, public_message, refuse
from tokenbudget.server.entrypoints.grpc.limits import refused_bytes
from tokenbudget.server.engine.request_builder import build_pooling_request, make_requests
from tokenbudget.server.entrypoints.grpc.lora_rpcs import lora_request_of
from tokenbudget.server.engine.client_strings import (
    DEFAULT_MAX_ID_BYTES,
    check_client_string,
    check_client_strings,
    quoted,
)
from tokenbudget.server.entrypoints.grpc.sglang_convert import (
    GatewayRequest,
    Replies,
    gateway_request,
    has_mm_inputs,
    model_info,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name

# In-band errors as the HTTP status the gateway gives its client.
_HTTP_STATUS_OF_ERROR: tuple[tuple[type[BaseException], str], ...] = (
    (DuplicateRequestError, "409"),
    (QueueFullError, "429"),
    (GrammarTimeoutError, "504"),
    (ValueError, "400"),
    (UnsupportedRequestError, "501"),  # gRPC UNIMPLEMENTED's HTTP twin
    (RequestFailedError, "500"),  # it alone failed inside the engine
)
_IN_BAND_ERRORS = tuple(t for t, _ in _HTTP_STATUS_OF_ERROR)


class SglangSchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """SglangScheduler on a grpc.aio server (every stream a coroutine).

    ``draining`` and ``ready`` are asyncio-free flags the CLI sets: HealthCheck
    reports healthy only once started (``ready``), while not draining, and
    while the engine runs."""

    # The longest request_id and cache_salt (the server's --max-id-bytes).
    max_id_bytes = DEFAULT_MAX_ID_BYTES

    def __init__(self, engine: AsyncEngine, *, served_model_name: str | None = None) -> None:
        self.engine = engine
        self.served_model_name = (
            served_model_name or getattr(engine, "served_model_name", None) or engine.model_name
        )
        self.ready = False
        self.draining = False
        self.start_time = time.time()
        self.last_receive_time = 0.0
        self._model_info = model_info(engine, self.served_model_name)
        # null, prefill or decode (--disaggregation-mode; the factory sets it on the engine).
        self.disaggregation_mode = getattr(engine, "disaggregation_mode", "null")

    # -- Generate ---------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.last_receive_time = time.time()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("SglangScheduler.Generate %s", _brief(request))
        if self.draining or not self.engine.healthy:
            refuse(context, grpc.StatusCode.UNAVAILABLE, self._unhealthy_reason())
            return
        if self.disaggregation_mode != "null":
            # The gateway answers its client once both halves sent headers: a
            # request queued (or waiting for its KV) must not hold them back.
            await context.send_initial_metadata(())
        try:  # off the loop: request building checks token ids and compiles nothing
            req, stream = await admit(self.engine, lambda a: self._submit(request, a))
        except _IN_BAND_ERRORS as exc:
            error = _error(_echo(request.request_id, self.max_id_bytes), exc)
        except EngineDeadError as exc:
            refuse(context, grpc.StatusCode.UNAVAILABLE, public_message(exc))
            return
        else:
            error = None
        if error is not None:  # sent outside the except: a suspended yield there holds the error
            refused_bytes.add(request.ByteSize())
            yield error
            return
        replies = Replies(req, stream.num_prompt_tokens)
        try:
            async for chunk in stream:
                for msg in replies.messages(chunk):
                    await context.write(msg)
        except _IN_BAND_ERRORS as exc:  # after queueing: a grammar that failed to compile
            await context.write(_error(req.request_id, exc))
        except EngineDeadError as exc:
            refuse(context, grpc.StatusCode.UNAVAILABLE, public_message(exc))
        finally:
            if not stream.finished:  # the gateway cancelled (its client went away)
                self.engine.abort(stream.request_id)  # free the KV before the next step

    def _submit(
        self, request: pb.GenerateRequest, admission: Admission
    ) -> tuple[GatewayRequest, RequestStream]:
        engine = self.engine
        req = gateway_request(request, engine.max_model_len, self.disaggregation_mode)
        check_client_strings(
            request.request_id or None, {"cache_salt": req.cache_salt}, self.max_id_bytes
        )
        # The gateway's lora_path: an adapter name (--lora-modules, LoadLoRAAdapter).
        lora = lora_request_of(engine, request.lora_id, "lora_id") if request.lora_id else None
        requests = make_requests(
            engine,
            req.request_id,
            {"prompt_token_ids": req.prompt_token_ids},
            req.params,
            priority=req.priority,
            cache_salt=req.cache_salt,
            lora_request=lora,
        )
        for i, r in enumerate(requests):  # one KV transfer per sample
            r.kv_transfer_params = req.kv_transfer_of(i)
        # The gateway detokenizes; we need text only to match stop strings.
        stream = admission.add_request(  # unless the gateway cancelled meanwhile
            requests, request_id=req.request_id, detokenize=bool(req.params.stop)
        )
        return req, stream

    # -- the other RPCs -------------------------------------------------------------------
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """The model's default pooling (the gateway's EmbedRequest has no
        pooling options); errors in band, as Generate's."""
        self.last_receive_time = time.time()
        if self.draining or not self.engine.healthy:
            refuse(context, grpc.StatusCode.UNAVAILABLE, self._unhealthy_reason())
            return None
        rid = request.request_id or uuid.uuid4().hex
        try:
            check_client_strings(rid, {}, self.max_id_bytes)
            req = await asyncio.get_running_loop().run_in_executor(
                None, self._embed_request, request, rid
            )
            stream = self.engine.add_request(req, request_id=rid, detokenize=False)
        except _IN_BAND_ERRORS as exc:
            refused_bytes.add(request.ByteSize())
            return _embed_error(_echo(rid, self.max_id_bytes), exc)
        except EngineDeadError as exc:
            refuse(context, grpc.StatusCode.UNAVAILABLE, public_message(exc))
            return None
        last = None
        try:
            async for chunk in stream:
                last = chunk
        except _IN_BAND_ERRORS as exc:
            return _embed_error(rid, exc)
        except EngineDeadError as exc:
            refuse(context, grpc.StatusCode.UNAVAILABLE, public_message(exc))
            return None
        finally:
            if not stream.finished:  # the gateway cancelled
                self.engine.abort(rid)
        if last is None or last.pooling_output is None:
            return pb.EmbedResponse(
                request_id=rid,
                error=pb.EmbedError(message=f"request {rid!r} was aborted", code="499"),
            )
        vector = last.pooling_output.tolist()
        return pb.EmbedResponse(
            request_id=rid,
            complete=pb.EmbedComplete(
                embedding=vector,
                prompt_tokens=req.num_prompt_tokens,
                cached_tokens=last.num_cached_tokens,
                embedding_dim=len(vector),
            ),
        )

    def _embed_request(self, request: pb.EmbedRequest, rid: str) -> Request:
        if has_mm_inputs(request):
            raise ValueError(
                "mm_inputs: multimodal inputs are not supported through the gateway protocol yet"
            )
        if request.is_cross_encoder:
            raise ValueError("is_cross_encoder: cross-encoder scoring is not supported")
        if request.token_type_ids:
            raise ValueError("token_type_ids: not supported (decoder embedders have none)")
        if request.texts:
            raise ValueError("texts: send one tokenized prompt per request")
        if request.data_parallel_rank > 0:
            raise ValueError(
                f"data_parallel_rank: this server has one rank (0), got "
                f"{request.data_parallel_rank}"
            )
        if not request.tokenized.input_ids:
            raise ValueError("tokenized.input_ids: the prompt must not be empty")
        engine = self.engine
        return build_pooling_request(
            engine.input_processor,
            rid,
            {"prompt_token_ids": list(request.tokenized.input_ids)},
            None,
            engine.pooler_config,
        )

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        reason = self._unhealthy_reason()
        return pb.HealthCheckResponse(healthy=reason is None, message=reason or "serving")

    def _unhealthy_reason(self) -> str | None:
        if not self.ready:
            return "starting"
        if self.draining:
            return "draining: the server is shutting down"
        if not self.engine.healthy:
            return "the engine stopped"
        return None

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if self.engine.abort(request.request_id):
            return pb.AbortResponse(success=True, message=f"aborted {quoted(request.request_id)}")
        return pb.AbortResponse(
            success=False, message=f"request_id {quoted(request.request_id)} is not live"
        )

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        return self._model_info

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        e = self.engine
        sched = e.scheduler_config
        msg = pb.GetServerInfoResponse(
            active_requests=e.num_requests,
            is_paused=False,
            last_receive_timestamp=self.last_receive_time,
            uptime_seconds=time.time() - self.start_time,
            sglang_version=f"tokenbudget {metadata.version('tokenbudget')}",
            server_type="grpc",
        )
        msg.start_time.FromSeconds(int(self.start_time))
        msg.server_args.update(
            {
                "model_path": e.model_name,
                "served_model_name": self.served_model_name,
                "tp_size": 1,
                "dp_size": 1,
                "context_length": sched.max_model_len,
                "max_running_requests": sched.max_num_seqs,
                "chunked_prefill_size": sched.max_num_batched_tokens,
                "page_size": e.cache_config.block_size,
                "schedule_policy": sched.policy,
                "disaggregation_mode": self.disaggregation_mode,
            }
        )
        msg.scheduler_info.update({"max_total_num_tokens": _token_capacity(e)})
        return msg

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        try:  # the engine thread answers between steps; the loop keeps serving meanwhile
            s = await asyncio.get_running_loop().run_in_executor(None, self.engine.get_stats)
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine did not answer in time")
        capacity = _token_capacity(self.engine)
        block_size = self.engine.cache_config.block_size
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        max_seqs = self.engine.scheduler_config.max_num_seqs
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=s.num_running,
            num_waiting_reqs=s.num_waiting,
            num_total_reqs=s.num_running + s.num_waiting,
            num_used_tokens=(s.num_total_blocks - s.num_free_blocks) * block_size,
            max_total_num_tokens=capacity,
            token_usage=s.kv_cache_usage,
            cache_hit_rate=hit_rate,
            utilization=s.num_running / max_seqs,
            max_running_requests=max_seqs,
        )
        return pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            version=metadata.version("tokenbudget"),
            dp_rank_count=1,
            loads=[load],
            aggregate=pb.AggregateMetrics(
                total_running_reqs=s.num_running,
                total_waiting_reqs=s.num_waiting,
                total_reqs=s.num_running + s.num_waiting,
                avg_token_usage=s.kv_cache_usage,
                avg_utilization=load.utilization,
            ),
        )


def _brief(request: pb.GenerateRequest) -> str:
    """The request for a debug line, its prompt as a token count."""
    shown = pb.GenerateRequest()
    shown.CopyFrom(request)
    shown.tokenized.Clear()
    return f"({len(request.tokenized.input_ids)} prompt tokens) " + str(shown).replace("\n", " ")


def _echo(request_id: str, max_bytes: int) -> str:
    """The id to echo in a refusal: a refused id (too long, unprintable) is not
    sent back."""
    try:
        check_client_string("request_id", request_id, max_bytes)
    except ValueError:
        return ""
    return request_id


def _error(request_id: str, exc: BaseException) -> pb.GenerateResponse:
    status = next(code for t, code in _HTTP_STATUS_OF_ERROR if isinstance(exc, t))
    return pb.GenerateResponse(
        request_id=request_id,
        error=pb.GenerateError(message=public_message(exc), http_status_code=status),
    )


def _embed_error(request_id: str, exc: BaseException) -> pb.EmbedResponse:
    status = next(code for t, code in _HTTP_STATUS_OF_ERROR if isinstance(exc, t))
    return pb.EmbedResponse(
        request_id=request_id, error=pb.EmbedError(message=public_message(exc), code=status)
    )


def _token_capacity(engine: AsyncEngine) -> int:
    cache = engine.cache_config
    return (cache.num_blocks - 1) * cache.block_size


def add_sglang_scheduler_servicer(
    server: grpc.aio.Server, engine: AsyncEngine, *, served_model_name: str | None = None
) -> SglangSchedulerServicer:
    """Host the gateway's worker protocol for ``engine`` on a grpc.aio ``server``
    (not started). Call ``servicer.ready = True`` once the server serves."""
    if not isinstance(server, grpc.aio.Server):
        raise TypeError("the SglangScheduler service needs a grpc.aio server")
    servicer = SglangSchedulerServicer(engine, served_model_name=served_model_name)
    add_servicer(pb_grpc.add_SglangSchedulerServicer_to_server, servicer, server)
    return servicer
