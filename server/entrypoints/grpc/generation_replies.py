"""The Generation service's replies: a request's Chunks as GenerateResponse
messages (``Replies``) and a pooling request's last Chunk as its EmbedResponse.
The service itself is generation.py."""

from __future__ import annotations

from tokenbudget.core.request import Request
from tokenbudget.proto import generate_pb2
from tokenbudget.server.engine.streams import Chunk


class Replies:
    """GenerateResponse messages of one request (a sample's usage goes on its last).
    The request id goes on the stream's first message only (the client chose
    it or learns it there): repeated, a long id would multiply into every token."""

    __slots__ = ("completion", "request", "request_id")

    def __init__(self, request: Request, request_id: str) -> None:
        self.request = request
        self.request_id = request_id
        self.completion: dict[int, int] = {}  # sample index -> tokens sent

    def message(self, chunk: Chunk) -> generate_pb2.GenerateResponse:
        first = not self.completion
        completion = self.completion.get(chunk.index, 0) + len(chunk.token_ids)
        self.completion[chunk.index] = completion
        msg = generate_pb2.GenerateResponse(
            request_id=self.request_id if first else "",
            index=chunk.index,
            token_ids=chunk.token_ids,
            text=chunk.text,
        )
        if chunk.logprobs:
            for per_token in chunk.logprobs:
                msg.logprobs.add(token_ids=per_token.keys(), logprobs=per_token.values())
        if chunk.prompt_logprobs:
            for per_token in chunk.prompt_logprobs:
                entry = msg.prompt_logprobs.add()
                if per_token:  # the first prompt token has none
                    entry.token_ids.extend(per_token.keys())
                    entry.logprobs.extend(per_token.values())
        if chunk.finish_reason is not None:
            msg.finish_reason = chunk.finish_reason
            if isinstance(chunk.stop_reason, str):
                msg.stop_string = chunk.stop_reason
            elif isinstance(chunk.stop_reason, int):
                msg.stop_token_id = chunk.stop_reason
            msg.usage.prompt_tokens = self.request.num_prompt_tokens
            msg.usage.completion_tokens = completion
            msg.usage.cached_tokens = chunk.num_cached_tokens
        return msg


def embed_response(
    request: Request, request_id: str, last: Chunk
) -> generate_pb2.EmbedResponse | None:
    """The reply; None when the request ended without a vector (an Abort)."""
    if last is None or last.pooling_output is None:
        return None
    params = request.pooling_params
    return generate_pb2.EmbedResponse(
        request_id=request_id,
        embedding=last.pooling_output.tolist(),
        usage=generate_pb2.Usage(
            prompt_tokens=request.num_prompt_tokens, cached_tokens=last.num_cached_tokens
        ),
        pooling_type=params.pooling_type,
        normalize=params.normalize,
    )
