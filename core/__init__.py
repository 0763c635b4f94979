"""tokenbudget.core: the scheduler, in pure Python (no torch)."""

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.sched.encoder_cache import EncoderCacheManager
from tokenbudget.core.kv import BlockPool, KVCacheBlock, KVCacheManager
from tokenbudget.core.outputs import (
    CachedRequestData,
    KVCacheSpec,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    RequestOutput,
    SchedulerOutput,
)
from tokenbudget.core.pooling_params import PoolerConfig, PoolingParams
from tokenbudget.core.request import MultiModalFeature, Request, RequestStatus
from tokenbudget.core.sampling_params import SamplingParams, StructuredOutputParams
from tokenbudget.core.failures import DuplicateRequestError, QueueFullError
from tokenbudget.core.lora import LoRAConfig, LoRARequest
from tokenbudget.core.sched.scheduler import Scheduler
from tokenbudget.core.sched.stats import SchedulerStats

__all__ = [
    "BlockPool",
    "CacheConfig",
    "CachedRequestData",
    "DuplicateRequestError",
    "EncoderCacheManager",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheSpec",
    "LoRAConfig",
    "LoRARequest",
    "ModelRunnerOutput",
    "MultiModalFeature",
    "NewRequestData",
    "PoolerConfig",
    "PoolingParams",
    "PromptLogprobs",
    "QueueFullError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputParams",
]
