"""A request as the scheduler sees it: tokens, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from tokenbudget.core.lora import LoRARequest
from tokenbudget.core.pooling_params import PoolingParams
from tokenbudget.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    # Failed inside the engine (core/failures.py); the other requests went on.
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class MultiModalFeature:
    """One multimodal item (an image) of a prompt.

    Its placeholder tokens are ``prompt[offset:offset + length]``; the encoder
    produces exactly ``length`` embeddings for it. ``data`` is whatever the
    worker needs to run the encoder (pixel values, grid); core never looks at it.
    """

    mm_hash: str
    offset: int
    length: int
    data: Any = None

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"mm feature {self.mm_hash}: offset must be >= 0 and "
                f"length >= 1, got offset={self.offset} length={self.length}"
            )


class Request:
    """One request as the scheduler sees it. ``tenant`` names who sent it (fair
    share); ``ttft_ms`` and ``tpot_ms`` are its latency targets (policy "slo",
    goodput).

    A pooling (embedding) request gives resolved ``pooling_params`` and no
    ``sampling_params``: it is scheduled as a prompt with one output token to
    come (max_tokens=1), computes its prompt only and finishes with the pooled
    vector instead of a token.

    ``kv_transfer_params``: its part in a disaggregated prefill/decode pair, a
    KVTransferParams (core/kv/connector.py; typed Any here since core.kv
    imports this module), or None."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "priority",
        "arrival_time",
        "mm_features",
        "cache_salt",
        "lora_id",
        "lora_request",
        "status",
        "num_computed_tokens",
        "output_token_ids",
        "all_token_ids",
        "spec_token_ids",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "num_output_placeholders",
        "stop_reason",
        "max_tokens",
        "num_prompt_tokens",
        "structured_request",
        "first_scheduled_time",
        "skip_reading_prefix_cache",
        "num_prompt_logprobs_sent",
        "tenant",
        "ttft_ms",
        "tpot_ms",
        "pooling_params",
        "kv_transfer_params",
        "__weakref__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        tenant: str | None = None,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: Any = None,
    ) -> None:
        sampling_params = _checked_params(
            request_id, prompt_token_ids, sampling_params, pooling_params, ttft_ms, tpot_ms
        )
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.mm_features = sorted(mm_features or [], key=lambda f: f.offset)
        self.cache_salt = cache_salt
        # The adapter (core/lora.py) whose id keys its blocks and its step slot.
        self.lora_request = lora_request
        self.lora_id = lora_id if lora_request is None else lora_request.lora_int_id
        self.tenant = tenant
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        # prompt + output, kept in one list so block hashing and resumption
        # never concatenate.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        # -1 until the request is first admitted.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Hashes of the full blocks of all_token_ids, extended incrementally.
        self.block_hashes: list[bytes] = []
        # Async scheduling: tokens the worker is producing that we have not seen.
        self.num_output_placeholders = 0
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Set by the structured-output manager for constrained requests.
        self.structured_request: Any = None
        self.first_scheduled_time: float | None = None
        self.pooling_params = pooling_params
        self.skip_reading_prefix_cache = _computes_whole_prompt(sampling_params, pooling_params)
        # Prompt tokens whose logprobs were output (token 0 has none: it starts at 1).
        self.num_prompt_logprobs_sent = 1
        self.kv_transfer_params = kv_transfer_params

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def _checked_params(
    request_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams | None,
    pooling_params: PoolingParams | None,
    ttft_ms: float | None,
    tpot_ms: float | None,
) -> SamplingParams:
    """The request's sampling params (a pooling request's: one token to come),
    after refusing what cannot be scheduled."""
    if pooling_params is not None:
        if sampling_params is not None:
            raise ValueError(
                f"request {request_id}: give sampling_params or pooling_params, not both"
            )
        if not pooling_params.is_resolved:
            raise ValueError(
                f"request {request_id}: pooling_params must be resolved "
                "against the model's PoolerConfig first"
            )
        sampling_params = SamplingParams(max_tokens=1)
    elif sampling_params is None:
        raise ValueError(f"request {request_id}: sampling_params must be given")
    if not prompt_token_ids:
        raise ValueError(f"request {request_id}: prompt_token_ids must not be empty")
    for name, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)):
        if value is not None and not value > 0:
            raise ValueError(f"request {request_id}: {name} must be > 0, got {value}")
    return sampling_params


def _computes_whole_prompt(
    sampling_params: SamplingParams, pooling_params: PoolingParams | None
) -> bool:
    """Whether a request must compute its whole prompt, reading no prefix-cache
    hit. Prompt logprobs need the logits of every prompt position, which a hit
    would skip. Likewise MEAN and CLS pooling need the hidden state of every
    prompt position (CLS: of position 0); LAST needs only the last token, which
    is always computed."""
    return sampling_params.prompt_logprobs is not None or (
        pooling_params is not None and pooling_params.pooling_type != "LAST"
    )
