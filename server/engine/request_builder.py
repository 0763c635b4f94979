"""A prompt and its SamplingParams as the engine's Requests: one per sample.

Shared by the offline ``LLM`` and the gRPC services so both build requests
the same way (vocabulary checks, bad words, truncation, EOS ids, ``n``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tokenbudget.core.pooling_params import PoolerConfig, PoolingParams
from tokenbudget.core.request import Request
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.server.engine.input_processor import InputProcessor, Prompt

if TYPE_CHECKING:
    from tokenbudget.server.engine.async_engine import AsyncEngine


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample ``index`` of ``n`` (the request's own id when n = 1)."""
    return request_id if n == 1 else f"{request_id}#{index}"


def build_requests(
    processor: InputProcessor,
    request_id: str,
    prompt: Prompt,
    params: SamplingParams,
    *,
    eos_token_ids: list[int] | None = None,
    **request_options,
) -> list[Request]:
    """The Requests of ``params.n`` samples of ``prompt``, in sample order.

    Samples share the prompt's KV through the prefix cache: the first one to
    be scheduled computes it, the others find its full blocks already cached
    (in the same step too: its blocks are registered when allocated, and a
    step writes every token's KV before attending). Sample i draws from seed
    ``seed + i``, so each is reproducible on its own. Prompt logprobs are
    computed by sample 0 only. ``request_options`` are Request's own keywords
    (priority, cache_salt, tenant, ttft_ms, tpot_ms), the same for every sample.

    ``max_tokens`` beyond what the context leaves (``max_model_len`` minus
    the prompt's tokens) is clamped to it, as vLLM does: such a request
    ends with finish reason "length" there anyway, and the clamped value is
    what the scheduler's admission reserve plans for. ``min_tokens`` is
    clamped with it.
    """
    try:
        params = processor.check_params(params)
    except ValueError as exc:
        raise ValueError(f"sampling_params.{exc}") from None
    token_ids, features = processor.process(prompt, params.truncate_prompt_tokens)
    if processor.max_model_len is not None:
        room = max(processor.max_model_len - len(token_ids), 1)
        if params.max_tokens > room:
            params = dataclasses.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
    eos, *more_eos = eos_token_ids or [None]
    if more_eos and not params.ignore_eos:
        # Request holds one EOS id; the checkpoint's others stop like stop tokens.
        params = dataclasses.replace(
            params, stop_token_ids=list(dict.fromkeys(params.stop_token_ids + more_eos))
        )
    check_allowed_tokens(params, eos)
    n = params.n
    samples = _sample_params(params)
    return [
        Request(
            sample_request_id(request_id, i, n),
            token_ids,
            p,
            eos_token_id=eos,
            mm_features=features,
            **request_options,
        )
        for i, p in enumerate(samples)
    ]


def check_allowed_tokens(params: SamplingParams, eos: int | None) -> None:
    """Refuse allowed_token_ids that other fields ban whole, before any step:
    the sampler would otherwise have no token to pick (it then fails the
    request mid-stream). ``eos``: the request's EOS id (its others are stop ids)."""
    allowed = params.allowed_token_ids
    if allowed is None:
        return
    always_banned = {seq[0] for seq in params.bad_words_token_ids or () if len(seq) == 1}
    if set(allowed) <= always_banned:
        raise ValueError(
            "sampling_params.allowed_token_ids: every allowed token is banned by "
            "bad_words / bad_words_token_ids"
        )
    stops = set(params.stop_token_ids) | ({eos} if eos is not None else set())
    if params.min_tokens > 0 and set(allowed) <= stops | always_banned:
        raise ValueError(
            "sampling_params.allowed_token_ids: every allowed token is an EOS or stop "
            f"token, which min_tokens={params.min_tokens} bans until then"
        )


def _sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The SamplingParams of each of ``params.n`` samples: sample i draws from
    seed ``seed + i``; only sample 0 computes prompt logprobs."""
    if params.n == 1:
        return [params]
    return [
        dataclasses.replace(
            params,
            n=1,
            seed=None if params.seed is None else params.seed + i,
            prompt_logprobs=params.prompt_logprobs if i == 0 else None,
        )
        for i in range(params.n)
    ]


def make_requests(
    engine: AsyncEngine, request_id: str, prompt: Prompt, params: SamplingParams, **request_options
) -> list[Request]:
    """The Requests of one request to a served ``engine`` (every gRPC front
    builds them here): a structured-output spec is parsed first, then
    build_requests with ``request_options`` (Request keywords: priority,
    cache_salt, tenant, ...). Raises ValueError naming the field."""
    try:  # the size bounds first: before a spec is parsed or a word tokenized
        engine.input_processor.request_limits.check(params)
    except ValueError as exc:
        raise ValueError(f"sampling_params.{exc}") from None
    if params.structured is not None:
        manager = engine.structured_output
        if manager is None:
            raise ValueError(
                "sampling_params.structured: structured output is not enabled on this server"
            )
        try:  # parsing only (milliseconds); the compile runs off the engine loop
            manager.validate(params.structured)
        except ValueError as exc:
            raise ValueError(f"sampling_params.{exc}") from None
    return build_requests(
        engine.input_processor,
        request_id,
        prompt,
        params,
        eos_token_ids=engine.eos_token_ids,
        **request_options,
    )


def build_pooling_request(
    processor: InputProcessor,
    request_id: str,
    prompt: Prompt,
    params: PoolingParams | None,
    pooler_config: PoolerConfig,
    **request_options,
) -> Request:
    """The Request of an embedding: ``params`` (None: the model's defaults)
    resolved against ``pooler_config``."""
    if params is not None and not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    resolved = (params or PoolingParams()).resolve(pooler_config)
    token_ids, features = processor.process(prompt)
    return Request(
        request_id,
        token_ids,
        None,
        mm_features=features,
        pooling_params=resolved,
        **request_options,
    )
