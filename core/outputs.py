"""What crosses the scheduler/worker boundary each step (plain dataclasses).

The gRPC layer converts these to and from protobuf in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenbudget.core.failures import RequestFailure
from tokenbudget.core.lora import LoRARequest
from tokenbudget.core.pooling_params import PoolingParams
from tokenbudget.core.request import MultiModalFeature
from tokenbudget.core.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """Everything a worker needs the first time it sees a request."""

    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    # With G KV cache groups (core/kv/groups.py), block j of group g sits at
    # j * G + g (here and in CachedRequestData.new_block_ids); G = 1: the table.
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: int | None = None
    # The EOS id that stops it (None with ignore_eos): min_tokens masks it.
    eos_token_id: int | None = None
    # Set for a pooling request (resolved): pool its prompt, sample nothing.
    pooling_params: PoolingParams | None = None
    # Its LoRA adapter (lora_id is its lora_int_id), or None for the base model.
    lora_request: LoRARequest | None = None
    # Tokens it already has past its prompt: a disaggregated decode's first
    # token, sampled by the prefill engine that computed its KV.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """Deltas for requests the worker already holds, one entry per index.

    For a request resumed after preemption, ``new_block_ids`` holds its whole
    block table (replacing the old one) and ``resumed_token_ids`` its full
    token ids (prompt + outputs so far); the worker dropped its KV on
    preemption but kept its sampling state.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (prompt chunk, 1 decode token,
    # or 1 + number of draft tokens).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft tokens to verify this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> indices into that request's mm_features to encode this step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    num_common_prefix_blocks: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # Packed int32 bitmask rows (numpy array) for the structured requests in
    # ``structured_req_ids`` order, or None; a Future of them for in-process
    # executors that opt in with ``defers_grammar_bitmask`` (server/engine/core.py).
    grammar_bitmask: Any = None
    structured_req_ids: list[str] = field(default_factory=list)
    # Async scheduling: the requests that must sample a token this step
    # (engine side only, not sent to workers), since later steps change the
    # counts; a reply without their token is a broken reply. (Without async
    # scheduling, num_computed_tokens >= num_tokens says it at update time.)
    must_sample: set[str] = field(default_factory=set)
    # KV copies the worker runs before this step's forward, all of
    # kv_swap_out first: (device block, host slot) and (host slot, device
    # block) pairs (core/kv/tiering.py).
    kv_swap_out: list[tuple[int, int]] = field(default_factory=list)
    kv_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # A KVConnectorMetadata (core/kv/connector.py; typed Any since core.kv
    # imports this module): the KV sends the workers start and cancel this
    # step; set on every step, empty ones included, while the connector has work.
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of a run of prompt tokens, computed during one prefill chunk."""

    start: int  # prompt position of the token entries[0] is about (>= 1)
    # Per token {prompt token id: logprob} plus the top-n.
    entries: list[dict[int, float]]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: empty while a prompt is still mid-prefill, one
    # token normally, up to 1 + drafts with speculative decoding.
    sampled_token_ids: list[list[int]]
    # Per request (same index), per sampled token: {token_id: logprob} holding
    # the sampled token and the top-n; None where not asked for.
    logprobs: list[list[dict[int, float]] | None] | None = None
    # Per request (same index): the pooled vector (a 1-D float32 CPU tensor)
    # of a pooling request in the step its prompt completes, else None.
    pooler_output: list[Any] | None = None
    # Per request (same index): draft tokens proposed for the next step.
    spec_token_ids: list[list[int]] | None = None
    # req_id -> the prompt logprobs of this step's chunk, for requests that asked.
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    # req_id -> why it failed this step (its sampled list is empty); the
    # scheduler finishes it with an error, the others proceed (core/failures.py).
    failed: dict[str, RequestFailure] | None = None
    # KV sends (core/kv/connector.py) that finished, and that failed (req_id ->
    # why), since the last step: nothing writes their blocks any more.
    finished_sending: set[str] | None = None
    failed_sending: dict[str, str] | None = None

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput([], {}, [])


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The KV cache a worker allocated, as ``Executor.initialize`` reports it:
    the scheduler sizes its block pools from this, not from the CacheConfig
    it asked with (which sized the cache by memory, or left the host tier in
    bytes)."""

    num_blocks: int  # device blocks, block 0 (the null block) included
    num_offload_blocks: int = 0  # host KV tier slots (0: no host tier)
    # Attention window of each KV cache group (0: full, W > 0: sliding, -C: chunks of
    # C, core/kv/groups.py); () is one full group.
    kv_group_windows: tuple[int, ...] = ()
    # Per TP rank, in rank order: how a peer engine reaches this rank's KV
    # (CacheConfig.kv_transfer_backend set; () otherwise).
    kv_transfer_handshakes: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_offload_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    # Why an aborted request failed (e.g. its grammar did not compile), for the caller to raise.
    error: Exception | None = None
    # Prompt logprobs computed this step, for prompt tokens 1.. in order (token
    # 0 has none); each {prompt token: logprob} plus the top-n.
    prompt_logprobs: list[dict[int, float]] | None = None
    # A pooling request's pooled vector (1-D float32 tensor), on its final output.
    pooling_output: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
