"""Client: a small Python client of the Generation service.

    with Client("localhost:50051") as c:
        print(c.generate("Hello", max_tokens=16, temperature=0).text)
        for chunk in c.generate_stream({"token_ids": [1, 2, 3]}, max_tokens=8):
            print(chunk.token_ids, chunk.text)
        vector = c.embed("Hello", pooling_type="MEAN").embedding

A server started with ``--api-key`` wants ``Client(..., api_key=KEY)``; one
serving TLS wants ``tls=True`` (the system's CAs) or ``root_certificates=``
the PEM bytes of its CA, and for mutual TLS ``certificate_chain=`` and
``private_key=`` of the client's own certificate.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tokenbudget.core.pooling_params import PoolingParams
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.proto import convert, generate_pb2, generate_pb2_grpc
from tokenbudget.proto.rpc.auth import bearer_metadata

Prompt = str | Sequence[int] | dict[str, Any]


@dataclass(slots=True)
class Completion:
    """One sample of a request, put together from its stream. ``generate``
    returns sample 0, whose ``samples`` lists all ``n`` of them (itself first)."""

    request_id: str
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    # The stop token id or stop string that ended the sample, if one did.
    stop_reason: int | str | None = None
    # Per generated token {token_id: logprob} (sampled + top-n), when asked for.
    logprobs: list[dict[int, float]] | None = None
    # Per prompt token (None for the first), when asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    samples: list[Completion] = field(default_factory=list)


@dataclass(slots=True)
class Embedding:
    """An Embed reply: the vector and the pooling the server applied."""

    request_id: str
    embedding: list[float]
    pooling_type: str
    normalize: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Client:
    def __init__(
        self,
        target: str,
        *,
        max_message_size: int = 64 << 20,
        channel: grpc.Channel | None = None,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        options = [
            ("grpc.max_send_message_length", max_message_size),
            ("grpc.max_receive_message_length", max_message_size),
        ]
        if channel is None and (tls or root_certificates or certificate_chain or private_key):
            credentials = grpc.ssl_channel_credentials(
                root_certificates, private_key, certificate_chain
            )
            channel = grpc.secure_channel(target, credentials, options=options)
        self.channel = channel or grpc.insecure_channel(target, options=options)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        # Sent with every call (the server's --api-key).
        self.metadata = bearer_metadata(api_key)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        timeout: float | None = None,
        lora_name: str | None = None,
        **sampling,
    ) -> Iterator[generate_pb2.GenerateResponse]:
        """Yield GenerateResponse messages (token_ids and text deltas; the last
        has finish_reason and usage). Breaking out of the loop cancels the
        request on the server. ``sampling`` keywords build a SamplingParams; the
        server's defaults (the model's generation_config) fill the fields
        neither names. Every message yielded carries the request id (the server
        sends it on the first only). ``lora_name``: the LoRA adapter to use
        (list_models() names them)."""
        request = make_request(
            prompt,
            sampling_params or SamplingParams(**sampling),
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            tenant=tenant,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            only=None if sampling_params is not None else sampling,
            lora_name=lora_name,
        )
        call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
        try:
            rid = ""
            for msg in call:
                if msg.request_id:
                    rid = msg.request_id
                else:
                    msg.request_id = rid
                yield msg
        finally:
            call.cancel()  # a no-op once the stream ended

    def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, **kwargs
    ) -> Completion:
        """Run one request to completion; returns its first sample (all of them
        in ``.samples``)."""
        samples: dict[int, Completion] = {}
        prompt_logprobs = None
        for msg in self.generate_stream(prompt, sampling_params, **kwargs):
            out = samples.get(msg.index)
            if out is None:
                out = samples[msg.index] = Completion(msg.request_id, msg.index)
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            if msg.logprobs:
                out.logprobs = (out.logprobs or []) + [
                    dict(zip(t.token_ids, t.logprobs)) for t in msg.logprobs
                ]
            if msg.prompt_logprobs:
                prompt_logprobs = [
                    dict(zip(t.token_ids, t.logprobs)) or None for t in msg.prompt_logprobs
                ]
            if msg.finish_reason:
                out.finish_reason = msg.finish_reason
                kind = msg.WhichOneof("stop_reason")
                out.stop_reason = getattr(msg, kind) if kind else None
                out.prompt_tokens = msg.usage.prompt_tokens
                out.completion_tokens = msg.usage.completion_tokens
                out.cached_tokens = msg.usage.cached_tokens
        assert samples, "the server ended the stream without a response"
        ordered = [samples[i] for i in sorted(samples)]
        first = ordered[0]
        first.samples = ordered
        first.prompt_logprobs = prompt_logprobs
        return first

    def embed(
        self,
        prompt: str | Sequence[int] | dict[str, Any],
        pooling_params: PoolingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        timeout: float | None = None,
        **pooling,
    ) -> Embedding:
        """The embedding of one prompt (text, token ids, ``{"prompt_token_ids":
        [...]}`` or ``{"text": ...}``). ``pooling`` keywords (pooling_type, normalize) build a
        PoolingParams; fields neither names take the model's default."""
        params = pooling_params or PoolingParams(**pooling)
        msg = generate_pb2.EmbedRequest(priority=priority)
        for name, value in (
            ("request_id", request_id),
            ("cache_salt", cache_salt),
            ("tenant", tenant),
        ):
            if value is not None:
                setattr(msg, name, value)
        if isinstance(prompt, dict) and "text" in prompt:
            prompt = prompt["text"]
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            ids = (
                prompt.get("prompt_token_ids", prompt.get("token_ids"))
                if isinstance(prompt, dict)
                else prompt
            )
            if ids is None:
                raise ValueError("prompt dict needs 'prompt_token_ids' or 'text'")
            msg.token_ids.ids.extend(ids)
            msg.token_ids.SetInParent()
        convert.pooling_params_to_proto(params, msg.pooling_params)
        reply = self.stub.Embed(msg, timeout=timeout, metadata=self.metadata)
        return Embedding(
            reply.request_id,
            list(reply.embedding),
            reply.pooling_type,
            reply.normalize,
            reply.usage.prompt_tokens,
            reply.usage.cached_tokens,
        )

    def abort(self, request_id: str) -> None:
        self.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), metadata=self.metadata)

    def model_info(self) -> generate_pb2.ModelInfo:
        return self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=self.metadata)

    def list_models(self) -> list[str]:
        """The served model's name, then the LoRA adapters' (vLLM's /v1/models)."""
        info = self.model_info()
        return [info.model, *(a.name for a in info.lora_adapters)]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> int:
        """Serve the PEFT folder ``lora_path`` (on the server) as ``lora_name``; its id."""
        msg = generate_pb2.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        return self.stub.LoadLoRAAdapter(msg, metadata=self.metadata).lora_int_id

    def unload_lora_adapter(self, lora_name: str) -> None:
        msg = generate_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name)
        self.stub.UnloadLoRAAdapter(msg, metadata=self.metadata)

    def stats(self) -> generate_pb2.Stats:
        return self.stub.GetStats(generate_pb2.GetStatsRequest(), metadata=self.metadata)

    def subscribe_kv_events(self, max_pending: int = 0):
        """The server's KV cache events (core/kv/events.py): an iterator of
        KVEventBatch, a snapshot first; ``cancel()`` on it ends the stream."""
        calls = self.stub.SubscribeKvEvents(
            generate_pb2.SubscribeKvEventsRequest(max_pending=max_pending)
        )
        return _KvEventStream(calls)


class _KvEventStream:
    def __init__(self, calls) -> None:
        self._calls = calls

    def __iter__(self):
        for msg in self._calls:
            yield convert.kv_event_batch_from_proto(msg)

    def cancel(self) -> None:
        self._calls.cancel()


def make_request(
    prompt: Prompt,
    sampling_params: SamplingParams,
    *,
    request_id: str | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    tenant: str | None = None,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    only: Collection[str] | None = None,
    lora_name: str | None = None,
) -> generate_pb2.GenerateRequest:
    """A GenerateRequest from a prompt: a string, a list of token ids,
    ``{"token_ids": [...]}``, ``{"text": ..., "images": [bytes]}`` or
    ``{"messages": [{"role": ..., "content": str | [{"type": "text"|"image", ...}]}]}``.
    ``only``: send just these sampling fields, leaving the others unset for
    the server to fill from the model's generation_config defaults."""
    msg = generate_pb2.GenerateRequest(priority=priority)
    if request_id is not None:
        msg.request_id = request_id
    for name, value in (
        ("cache_salt", cache_salt),
        ("tenant", tenant),
        ("ttft_ms", ttft_ms),
        ("tpot_ms", tpot_ms),
        ("lora_name", lora_name),
    ):
        if value is not None:
            setattr(msg, name, value)
    convert.sampling_params_to_proto(sampling_params, msg.sampling_params)
    if only is not None:
        for f, _ in msg.sampling_params.ListFields():
            if f.name not in only:
                msg.sampling_params.ClearField(f.name)
    if isinstance(prompt, str):
        msg.text = prompt
    elif isinstance(prompt, dict):
        if "messages" in prompt:
            for m in prompt["messages"]:
                _add_message(msg.chat.messages.add(role=m["role"]), m["content"])
            msg.chat.SetInParent()
        elif "prompt_token_ids" in prompt or "token_ids" in prompt:
            # "prompt_token_ids" as LLM.generate takes it; "token_ids" also works.
            msg.token_ids.ids.extend(prompt.get("prompt_token_ids", prompt.get("token_ids")))
            msg.token_ids.SetInParent()
        elif "text" in prompt:
            msg.text = prompt["text"]
        else:
            raise ValueError("prompt dict needs 'messages', 'prompt_token_ids' or 'text'")
        msg.images.extend(prompt.get("images", ()))
    else:
        msg.token_ids.ids.extend(prompt)
        msg.token_ids.SetInParent()
    return msg


def _add_message(out: generate_pb2.ChatMessage, content: str | list[dict]) -> None:
    if isinstance(content, str):
        out.content.add(text=content)
        return
    for part in content:
        if part["type"] == "text":
            out.content.add(text=part["text"])
        elif part["type"] == "image":
            out.content.add(image=part["image"])
        else:
            raise ValueError(f"unknown content part type {part['type']!r}")


__all__ = ["Client", "Completion", "Embedding", "make_request"]
