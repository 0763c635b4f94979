"""The SGLang gateway's messages in engine terms, both ways.

In: a GenerateRequest becomes a GatewayRequest (our SamplingParams and the
Request options), refusing with a ValueError naming the field what we do not
serve; errors about our SamplingParams use the gateway's field names. Out: a
request's Chunks become its GenerateResponses (``Replies``), and the model
becomes GetModelInfo's answer. The service (sglang.py) does the rest.
"""

from __future__ import annotations

import dataclasses
import uuid

from tokenbudget.core.kv.connector import DECODE, PREFILL, KVTransferParams
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.proto import sglang_scheduler_pb2 as pb
from tokenbudget.server.engine.async_engine import AsyncEngine
from tokenbudget.server.engine.pooler_defaults import is_embedding_checkpoint
from tokenbudget.server.engine.streams import Chunk

# custom_params keys we honour (the protocol has no field for them).
_CUSTOM_PARAMS = ("priority", "cache_salt")


@dataclasses.dataclass(slots=True)
class GatewayRequest:
    """One GenerateRequest in engine terms."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    priority: int = 0
    cache_salt: str | None = None
    # Send a streamed sample's tokens once this many piled up (and at its end).
    stream_interval: int = 1
    # return_logprob: top-n per output token; input logprobs from this prompt position.
    top_logprobs: int | None = None
    input_logprobs_from: int | None = None
    # Disaggregated prefill/decode: this server's part in it (sample 0's room).
    kv_transfer: KVTransferParams | None = None

    def kv_transfer_of(self, index: int) -> KVTransferParams | None:
        """Sample ``index``'s part: each sample is a transfer of its own, and
        the prefill and the decode (sent the same request) derive the same
        room for it. The gateway sends n > 1 as one request with one room."""
        kv = self.kv_transfer
        if kv is None or index == 0:
            return kv
        return dataclasses.replace(kv, room=kv.room + (index << 32))


def gateway_request(
    request: pb.GenerateRequest, max_model_len: int, disaggregation_mode: str = "null"
) -> GatewayRequest:
    """Convert, refusing what we do not serve with a ValueError naming the
    field. ``disaggregation_mode``: the server's (null, prefill or decode)."""
    _refuse_unsupported(request)
    kv_transfer = _kv_transfer(request, disaggregation_mode)
    num_prompt_tokens = len(request.tokenized.input_ids)
    if not num_prompt_tokens:
        raise ValueError("tokenized.input_ids: the prompt must not be empty")
    if num_prompt_tokens > max_model_len:  # before the ids become a Python list
        raise ValueError(
            f"tokenized.input_ids: the prompt has {num_prompt_tokens} tokens, more "
            f"than the context length {max_model_len}"
        )
    prompt = list(request.tokenized.input_ids)
    sp = request.sampling_params
    kwargs = _sampling_kwargs(sp, max_model_len, len(prompt))
    if disaggregation_mode == PREFILL:
        # The prefill computes the prompt and samples the first token; the decode does the rest.
        kwargs["max_tokens"], kwargs["min_tokens"] = 1, min(kwargs["min_tokens"], 1)
    top_logprobs, input_from = _logprob_kwargs(request, len(prompt), kwargs)
    if sp.HasField("stream_interval") and sp.stream_interval < 1:
        raise ValueError(f"sampling_params.stream_interval must be >= 1, got {sp.stream_interval}")
    custom = _custom_params(sp)
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise ValueError(f"sampling_params.{_sglang_name(str(exc))}") from None
    return GatewayRequest(
        request.request_id or uuid.uuid4().hex,
        prompt,
        params,
        request.stream,
        priority=custom.get("priority", 0),
        cache_salt=custom.get("cache_salt"),
        stream_interval=sp.stream_interval if sp.HasField("stream_interval") else 1,
        top_logprobs=top_logprobs,
        input_logprobs_from=input_from,
        kv_transfer=kv_transfer,
    )


def _kv_transfer(request: pb.GenerateRequest, mode: str) -> KVTransferParams | None:
    """The request's part in a prefill/decode pair, from the gateway's
    disaggregated_params (an empty bootstrap_host is none), on a server of
    ``mode``. A prefill or decode server serves only such requests: SGLang's
    runs every request of such a server through its KV transfer, so one
    without the params is refused here at once rather than failing later."""
    dp = request.disaggregated_params
    given = request.HasField("disaggregated_params") and bool(dp.bootstrap_host)
    if mode not in (PREFILL, DECODE):
        if given:
            raise ValueError(
                "disaggregated_params: this server is not part of a prefill/decode pair "
                "(start it with --disaggregation-mode prefill or decode)"
            )
        return None
    if not given:
        raise ValueError(
            f"disaggregated_params: this server is the {mode} half of a prefill/decode "
            "pair (--disaggregation-mode "
            f"{mode}): it serves only requests from a gateway in --pd-disaggregation mode "
            "(bootstrap_host, bootstrap_port and bootstrap_room set)"
        )
    if request.return_logprob:
        raise ValueError(
            "return_logprob: logprobs are not supported with disaggregated prefill/decode yet"
        )
    if mode == PREFILL:
        return KVTransferParams(PREFILL, dp.bootstrap_room)
    if not 1 <= dp.bootstrap_port <= 65535:
        raise ValueError(
            f"disaggregated_params.bootstrap_port must be in 1..65535, got {dp.bootstrap_port}"
        )
    return KVTransferParams(DECODE, dp.bootstrap_room, dp.bootstrap_host, dp.bootstrap_port)


def _sampling_kwargs(sp: pb.SamplingParams, max_model_len: int, num_prompt_tokens: int) -> dict:
    """Our SamplingParams' keywords for the gateway's sampling_params."""
    kwargs: dict = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "min_p": sp.min_p,
        "frequency_penalty": sp.frequency_penalty,
        "presence_penalty": sp.presence_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "stop": list(sp.stop),
        "stop_token_ids": list(sp.stop_token_ids),
        "skip_special_tokens": sp.skip_special_tokens,
        "spaces_between_special_tokens": sp.spaces_between_special_tokens,
        "n": sp.n or 1,
        "min_tokens": sp.min_new_tokens,
        "ignore_eos": sp.ignore_eos,
        "include_stop_str_in_output": sp.no_stop_trim,
        "logit_bias": dict(sp.logit_bias) or None,
        # OpenAI's rule without max_tokens: up to the context length.
        "max_tokens": (
            sp.max_new_tokens
            if sp.HasField("max_new_tokens")
            else max(max_model_len - num_prompt_tokens, 1)
        ),
    }
    constraint = sp.WhichOneof("constraint")
    if constraint == "structural_tag":
        raise ValueError(
            "sampling_params.structural_tag: structural tags are not supported "
            "(use regex, json_schema or ebnf_grammar)"
        )
    if constraint is not None:
        kind = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "grammar"}
        kwargs["structured"] = {kind[constraint]: getattr(sp, constraint)}
    return kwargs


def _logprob_kwargs(
    request: pb.GenerateRequest, num_prompt_tokens: int, kwargs: dict
) -> tuple[int | None, int | None]:
    """Add return_logprob's keywords to ``kwargs``; returns (top_logprobs, input_from)."""
    top_logprobs = input_from = None
    if request.return_logprob:
        if request.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {request.top_logprobs_num}")
        top_logprobs = request.top_logprobs_num
        kwargs["logprobs"] = top_logprobs
        if request.logprob_start_len >= 0:
            if request.logprob_start_len >= num_prompt_tokens:
                raise ValueError(
                    f"logprob_start_len must be < the prompt length "
                    f"({num_prompt_tokens}), got {request.logprob_start_len}"
                )
            input_from = request.logprob_start_len
            kwargs["prompt_logprobs"] = top_logprobs
    return top_logprobs, input_from


# Our SamplingParams' names in errors, as the gateway's client knows them.
_SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "include_stop_str_in_output": "no_stop_trim",
}


def _sglang_name(message: str) -> str:
    for ours, theirs in _SGLANG_NAMES.items():
        if message.startswith(ours + " ") or message.startswith(ours + "."):
            return theirs + message[len(ours) :]
    return message


def has_mm_inputs(request: pb.GenerateRequest | pb.EmbedRequest) -> bool:
    """Whether the gateway sent any multimodal input (an empty message is none)."""
    mm = request.mm_inputs
    return request.HasField("mm_inputs") and bool(
        mm.image_urls
        or mm.video_urls
        or mm.audio_urls
        or mm.image_data
        or mm.video_data
        or mm.audio_data
        or mm.HasField("processed_features")
    )


def _refuse_unsupported(request: pb.GenerateRequest) -> None:
    if has_mm_inputs(request):
        raise ValueError(
            "mm_inputs: multimodal inputs are not supported through the gateway "
            "protocol yet (use tokenbudget.v1.Generation)"
        )
    if request.token_ids_logprob:
        raise ValueError("token_ids_logprob: logprobs of chosen token ids are not supported")
    if request.return_hidden_states:
        raise ValueError("return_hidden_states: hidden states are not supported")
    if request.custom_logit_processor:
        raise ValueError("custom_logit_processor: custom logit processors are not supported")
    if request.input_embeds:
        raise ValueError("input_embeds: input embeddings are not supported")
    if request.data_parallel_rank > 0:
        raise ValueError(
            f"data_parallel_rank: this server has one rank (0), got {request.data_parallel_rank}"
        )
    if request.need_wait_for_encoder:
        raise ValueError("need_wait_for_encoder: encoder disaggregation is not supported")


def _custom_params(sp: pb.SamplingParams) -> dict:
    if not sp.HasField("custom_params"):
        return {}
    out: dict = {}
    for key, value in sp.custom_params.items():
        if key == "priority" and isinstance(value, float) and value.is_integer():
            out[key] = int(value)
        elif key == "cache_salt" and isinstance(value, str) and value:
            out[key] = value
        elif key in _CUSTOM_PARAMS:
            raise ValueError(
                f"sampling_params.custom_params.{key}: expected "
                f"{'an integer' if key == 'priority' else 'a non-empty string'}, "
                f"got {value!r}"
            )
        else:
            raise ValueError(
                f"sampling_params.custom_params.{key}: not supported (only "
                f"{', '.join(_CUSTOM_PARAMS)})"
            )
    return out


class _Sample:
    """What has been sent of one sample."""

    __slots__ = ("completion", "output_ids", "pending", "logprobs", "pending_logprobs")

    def __init__(self) -> None:
        self.completion = 0
        self.output_ids: list[int] = []  # every token (the complete of a non-streamed one)
        self.pending: list[int] = []  # streamed tokens not sent yet (stream_interval)
        self.logprobs: list[dict[int, float]] = []
        self.pending_logprobs: list[dict[int, float]] = []


class Replies:
    """GenerateResponses of one request: per sample, chunks (when streaming)
    then one complete."""

    def __init__(self, req: GatewayRequest, num_prompt_tokens: int) -> None:
        self.req = req
        self.num_prompt_tokens = num_prompt_tokens
        self.samples: dict[int, _Sample] = {}
        self.input_logprobs: pb.InputLogProbs | None = None
        self.input_logprobs_sent = False

    def messages(self, chunk: Chunk) -> list[pb.GenerateResponse]:
        req = self.req
        s = self.samples.setdefault(chunk.index, _Sample())
        s.completion += len(chunk.token_ids)
        s.output_ids += chunk.token_ids
        if chunk.prompt_logprobs is not None and req.input_logprobs_from is not None:
            self.input_logprobs = self._input_logprobs(chunk.prompt_logprobs)
        keep_logprobs = req.top_logprobs is not None and chunk.logprobs
        if keep_logprobs:
            s.logprobs += chunk.logprobs
        out = []
        if req.stream:
            s.pending += chunk.token_ids
            if keep_logprobs:
                s.pending_logprobs += chunk.logprobs
            if s.pending and (len(s.pending) >= req.stream_interval or chunk.finish_reason):
                msg = pb.GenerateStreamChunk(
                    token_ids=s.pending,
                    prompt_tokens=self.num_prompt_tokens,
                    completion_tokens=s.completion,
                    cached_tokens=chunk.num_cached_tokens,
                    index=chunk.index,
                )
                if req.top_logprobs is not None:
                    msg.output_logprobs.CopyFrom(
                        self._output_logprobs(s.pending, s.pending_logprobs)
                    )
                if self.input_logprobs is not None and not self.input_logprobs_sent:
                    msg.input_logprobs.CopyFrom(self.input_logprobs)
                    self.input_logprobs_sent = True
                out.append(pb.GenerateResponse(request_id=req.request_id, chunk=msg))
                s.pending, s.pending_logprobs = [], []
        if chunk.finish_reason is not None:
            # Streamed, the tokens went in chunks: the gateway would emit them twice.
            done = pb.GenerateComplete(
                output_ids=[] if req.stream else s.output_ids,
                finish_reason=chunk.finish_reason,
                prompt_tokens=self.num_prompt_tokens,
                completion_tokens=s.completion,
                cached_tokens=chunk.num_cached_tokens,
                index=chunk.index,
            )
            if isinstance(chunk.stop_reason, str):
                done.matched_stop_str = chunk.stop_reason
            elif isinstance(chunk.stop_reason, int):
                done.matched_token_id = chunk.stop_reason
            if req.top_logprobs is not None:
                done.output_logprobs.CopyFrom(self._output_logprobs(s.output_ids, s.logprobs))
            if self.input_logprobs is not None:
                done.input_logprobs.CopyFrom(self.input_logprobs)
            out.append(pb.GenerateResponse(request_id=req.request_id, complete=done))
        return out

    def _output_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]]
    ) -> pb.OutputLogProbs:
        msg = pb.OutputLogProbs()
        for token, per_token in zip(token_ids, logprobs):
            msg.token_ids.append(token)
            msg.token_logprobs.append(per_token.get(token, float("nan")))
            msg.top_logprobs.append(self._top(per_token))
        return msg

    def _input_logprobs(self, prompt_logprobs: list[dict[int, float] | None]) -> pb.InputLogProbs:
        msg = pb.InputLogProbs()
        start = self.req.input_logprobs_from or 0
        for token, per_token in zip(self.req.prompt_token_ids[start:], prompt_logprobs[start:]):
            msg.token_ids.append(token)
            entry = msg.token_logprobs.add()
            if per_token:  # the first prompt token has none
                entry.value = per_token[token]
            msg.top_logprobs.append(self._top(per_token or {}))
        return msg

    def _top(self, per_token: dict[int, float]) -> pb.TopLogProbs:
        best = sorted(per_token.items(), key=lambda kv: -kv[1])[: self.req.top_logprobs]
        return pb.TopLogProbs(token_ids=[t for t, _ in best], values=[v for _, v in best])


def model_info(engine: AsyncEngine, served_model_name: str) -> pb.GetModelInfoResponse:
    """From the checkpoint's config (the gateway reads its tokenizer itself).
    ``is_generation`` is False for an embedding checkpoint, as SGLang and vLLM
    say; we still serve Generate for it. sglang-router 0.3.2 only copies the
    field into the worker's labels: it routes /v1/chat/completions and
    /v1/embeddings to a worker either way."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(engine.model_name)
    text = config.get_text_config()
    tokenizer = engine.input_processor.tokenizer
    max_len = engine.max_model_len
    return pb.GetModelInfoResponse(
        model_path=engine.model_name,
        tokenizer_path=engine.model_name,
        is_generation=not is_embedding_checkpoint(engine.model_name),
        served_model_name=served_model_name,
        max_context_length=max_len,
        vocab_size=engine.input_processor.vocab_size,
        supports_vision=engine.is_vision_language,
        model_type=config.model_type or "",
        eos_token_ids=engine.eos_token_ids,
        pad_token_id=_int_or_zero(getattr(tokenizer, "pad_token_id", None)),
        bos_token_id=_int_or_zero(getattr(text, "bos_token_id", None)),
        max_req_input_len=max_len - 1,
        architectures=list(config.architectures or []),
    )


def _int_or_zero(value) -> int:
    return value if isinstance(value, int) else 0
