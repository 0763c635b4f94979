from tokenbudget.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheConfig(_message.Message):
    __slots__ = ("block_size", "num_blocks", "enable_prefix_caching", "kv_cache_memory_bytes", "gpu_memory_utilization", "hash_algo", "kv_offload_memory_bytes", "num_offload_blocks", "kv_load_blocks_per_step", "enable_kv_cache_events", "kv_transfer_backend")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_BLOCKS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    ENABLE_KV_CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    hash_algo: str
    kv_offload_memory_bytes: int
    num_offload_blocks: int
    kv_load_blocks_per_step: int
    enable_kv_cache_events: bool
    kv_transfer_backend: str
    def __init__(self, block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., kv_cache_memory_bytes: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ..., hash_algo: _Optional[str] = ..., kv_offload_memory_bytes: _Optional[int] = ..., num_offload_blocks: _Optional[int] = ..., kv_load_blocks_per_step: _Optional[int] = ..., enable_kv_cache_events: _Optional[bool] = ..., kv_transfer_backend: _Optional[str] = ...) -> None: ...

class SpeculativeConfig(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ...) -> None: ...

class SchedulerConfig(_message.Message):
    __slots__ = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "long_prefill_token_threshold", "policy", "encoder_compute_budget", "encoder_cache_size", "async_scheduling", "speculative_config")
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LONG_PREFILL_TOKEN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ENCODER_COMPUTE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    long_prefill_token_threshold: int
    policy: str
    encoder_compute_budget: int
    encoder_cache_size: int
    async_scheduling: bool
    speculative_config: SpeculativeConfig
    def __init__(self, max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., long_prefill_token_threshold: _Optional[int] = ..., policy: _Optional[str] = ..., encoder_compute_budget: _Optional[int] = ..., encoder_cache_size: _Optional[int] = ..., async_scheduling: _Optional[bool] = ..., speculative_config: _Optional[_Union[SpeculativeConfig, _Mapping]] = ...) -> None: ...

class InitializeRequest(_message.Message):
    __slots__ = ("model", "dtype", "device", "attention_backend", "cache_config", "scheduler_config", "enforce_eager", "lora_config")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_EAGER_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    device: str
    attention_backend: str
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    enforce_eager: bool
    lora_config: LoRAConfig
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., cache_config: _Optional[_Union[CacheConfig, _Mapping]] = ..., scheduler_config: _Optional[_Union[SchedulerConfig, _Mapping]] = ..., enforce_eager: _Optional[bool] = ..., lora_config: _Optional[_Union[LoRAConfig, _Mapping]] = ...) -> None: ...

class LoRAConfig(_message.Message):
    __slots__ = ("max_loras", "max_lora_rank", "max_cpu_loras")
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    def __init__(self, max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ...) -> None: ...

class InitializeResponse(_message.Message):
    __slots__ = ("num_blocks", "num_offload_blocks", "kv_group_windows", "kv_transfer_handshakes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_HANDSHAKES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_offload_blocks: int
    kv_group_windows: _containers.RepeatedScalarFieldContainer[int]
    kv_transfer_handshakes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, num_blocks: _Optional[int] = ..., num_offload_blocks: _Optional[int] = ..., kv_group_windows: _Optional[_Iterable[int]] = ..., kv_transfer_handshakes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MultiModalFeature(_message.Message):
    __slots__ = ("mm_hash", "offset", "length", "data")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    offset: int
    length: int
    data: _common_pb2.Value
    def __init__(self, mm_hash: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., data: _Optional[_Union[_common_pb2.Value, _Mapping]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "handle", "prompt_token_ids", "mm_features", "sampling_params", "block_ids", "num_computed_tokens", "lora_id", "eos_token_id", "pooling_params", "lora_name", "lora_path", "output_token_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    handle: int
    prompt_token_ids: bytes
    mm_features: _containers.RepeatedCompositeFieldContainer[MultiModalFeature]
    sampling_params: _common_pb2.SamplingParams
    block_ids: bytes
    num_computed_tokens: int
    lora_id: int
    eos_token_id: int
    pooling_params: _common_pb2.PoolingParams
    lora_name: str
    lora_path: str
    output_token_ids: bytes
    def __init__(self, req_id: _Optional[str] = ..., handle: _Optional[int] = ..., prompt_token_ids: _Optional[bytes] = ..., mm_features: _Optional[_Iterable[_Union[MultiModalFeature, _Mapping]]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[int] = ..., lora_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., pooling_params: _Optional[_Union[_common_pb2.PoolingParams, _Mapping]] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., output_token_ids: _Optional[bytes] = ...) -> None: ...

class RaggedIds(_message.Message):
    __slots__ = ("num_lists", "flat", "counts", "sparse", "rows")
    NUM_LISTS_FIELD_NUMBER: _ClassVar[int]
    FLAT_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    num_lists: int
    flat: bytes
    counts: bytes
    sparse: bool
    rows: bytes
    def __init__(self, num_lists: _Optional[int] = ..., flat: _Optional[bytes] = ..., counts: _Optional[bytes] = ..., sparse: _Optional[bool] = ..., rows: _Optional[bytes] = ...) -> None: ...

class CachedRequests(_message.Message):
    __slots__ = ("handles", "new_block_ids", "num_computed_tokens", "resumed_token_ids")
    class ResumedTokenIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _common_pb2.TokenIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    handles: bytes
    new_block_ids: RaggedIds
    num_computed_tokens: bytes
    resumed_token_ids: _containers.MessageMap[int, _common_pb2.TokenIds]
    def __init__(self, handles: _Optional[bytes] = ..., new_block_ids: _Optional[_Union[RaggedIds, _Mapping]] = ..., num_computed_tokens: _Optional[bytes] = ..., resumed_token_ids: _Optional[_Mapping[int, _common_pb2.TokenIds]] = ...) -> None: ...

class SchedulerOutput(_message.Message):
    __slots__ = ("step_id", "scheduled_new_reqs", "scheduled_cached_reqs", "scheduled_handles", "num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_spec_decode_tokens", "scheduled_encoder_inputs", "num_common_prefix_blocks", "finished_handles", "preempted_handles", "free_encoder_mm_hashes", "grammar_bitmask", "structured_handles", "finished_unsent_req_ids", "preempted_unsent_req_ids", "repeats_last_step", "kv_swap_out", "kv_swap_in", "kv_connector_metadata")
    class ScheduledSpecDecodeTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _common_pb2.TokenIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...
    class ScheduledEncoderInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _common_pb2.TokenIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_NEW_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_CACHED_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_SPEC_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_ENCODER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMON_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    FREE_ENCODER_MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNSENT_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_UNSENT_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_METADATA_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    scheduled_new_reqs: _containers.RepeatedCompositeFieldContainer[NewRequest]
    scheduled_cached_reqs: CachedRequests
    scheduled_handles: bytes
    num_scheduled_tokens: bytes
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: _containers.MessageMap[int, _common_pb2.TokenIds]
    scheduled_encoder_inputs: _containers.MessageMap[int, _common_pb2.TokenIds]
    num_common_prefix_blocks: int
    finished_handles: bytes
    preempted_handles: bytes
    free_encoder_mm_hashes: _containers.RepeatedScalarFieldContainer[str]
    grammar_bitmask: _common_pb2.Tensor
    structured_handles: bytes
    finished_unsent_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_unsent_req_ids: _containers.RepeatedScalarFieldContainer[str]
    repeats_last_step: bool
    kv_swap_out: bytes
    kv_swap_in: bytes
    kv_connector_metadata: KVConnectorMetadata
    def __init__(self, step_id: _Optional[int] = ..., scheduled_new_reqs: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., scheduled_cached_reqs: _Optional[_Union[CachedRequests, _Mapping]] = ..., scheduled_handles: _Optional[bytes] = ..., num_scheduled_tokens: _Optional[bytes] = ..., total_num_scheduled_tokens: _Optional[int] = ..., scheduled_spec_decode_tokens: _Optional[_Mapping[int, _common_pb2.TokenIds]] = ..., scheduled_encoder_inputs: _Optional[_Mapping[int, _common_pb2.TokenIds]] = ..., num_common_prefix_blocks: _Optional[int] = ..., finished_handles: _Optional[bytes] = ..., preempted_handles: _Optional[bytes] = ..., free_encoder_mm_hashes: _Optional[_Iterable[str]] = ..., grammar_bitmask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., structured_handles: _Optional[bytes] = ..., finished_unsent_req_ids: _Optional[_Iterable[str]] = ..., preempted_unsent_req_ids: _Optional[_Iterable[str]] = ..., repeats_last_step: _Optional[bool] = ..., kv_swap_out: _Optional[bytes] = ..., kv_swap_in: _Optional[bytes] = ..., kv_connector_metadata: _Optional[_Union[KVConnectorMetadata, _Mapping]] = ...) -> None: ...

class KVSend(_message.Message):
    __slots__ = ("request_id", "src_block_ids", "dst_block_ids", "peer_handshakes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PEER_HANDSHAKES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    src_block_ids: bytes
    dst_block_ids: bytes
    peer_handshakes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., src_block_ids: _Optional[bytes] = ..., dst_block_ids: _Optional[bytes] = ..., peer_handshakes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVConnectorMetadata(_message.Message):
    __slots__ = ("sends", "cancels")
    SENDS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    sends: _containers.RepeatedCompositeFieldContainer[KVSend]
    cancels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sends: _Optional[_Iterable[_Union[KVSend, _Mapping]]] = ..., cancels: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestLogprobs(_message.Message):
    __slots__ = ("present", "tokens")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    present: bool
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, present: _Optional[bool] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ModelRunnerOutput(_message.Message):
    __slots__ = ("step_id", "req_ids", "sampled_token_ids", "has_logprobs", "logprobs", "has_pooler_output", "pooler_output", "has_spec_token_ids", "spec_token_ids", "error", "prompt_logprobs", "failed", "finished_sending", "failed_sending")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RequestFailure
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RequestFailure, _Mapping]] = ...) -> None: ...
    class FailedSendingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_POOLER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    POOLER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    HAS_SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SENDING_FIELD_NUMBER: _ClassVar[int]
    FAILED_SENDING_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: RaggedIds
    has_logprobs: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[RequestLogprobs]
    has_pooler_output: bool
    pooler_output: _containers.RepeatedCompositeFieldContainer[_common_pb2.Value]
    has_spec_token_ids: bool
    spec_token_ids: RaggedIds
    error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    failed: _containers.MessageMap[str, RequestFailure]
    finished_sending: _containers.RepeatedScalarFieldContainer[str]
    failed_sending: _containers.ScalarMap[str, str]
    def __init__(self, step_id: _Optional[int] = ..., req_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Union[RaggedIds, _Mapping]] = ..., has_logprobs: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[RequestLogprobs, _Mapping]]] = ..., has_pooler_output: _Optional[bool] = ..., pooler_output: _Optional[_Iterable[_Union[_common_pb2.Value, _Mapping]]] = ..., has_spec_token_ids: _Optional[bool] = ..., spec_token_ids: _Optional[_Union[RaggedIds, _Mapping]] = ..., error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., failed: _Optional[_Mapping[str, RequestFailure]] = ..., finished_sending: _Optional[_Iterable[str]] = ..., failed_sending: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RequestFailure(_message.Message):
    __slots__ = ("message", "invalid_argument")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INVALID_ARGUMENT_FIELD_NUMBER: _ClassVar[int]
    message: str
    invalid_argument: bool
    def __init__(self, message: _Optional[str] = ..., invalid_argument: _Optional[bool] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "start", "entries")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start: int
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, req_id: _Optional[str] = ..., start: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("healthy", "detail", "num_steps", "busy_seconds", "wall_seconds")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    detail: str
    num_steps: int
    busy_seconds: float
    wall_seconds: float
    def __init__(self, healthy: _Optional[bool] = ..., detail: _Optional[str] = ..., num_steps: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
