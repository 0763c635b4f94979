"""Scheduler and cache configuration: one dataclass per concern."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority", "lpm", "dfs-weight", "lof", "random")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    # Caps one request's prefill chunk per step; 0 means no cap.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # Encoder (vision) compute budget per step and cache capacity, in embeddings.
    encoder_compute_budget: int = 8192
    encoder_cache_size: int = 8192
    # Draft tokens per step for speculative decoding (0: off).
    num_speculative_tokens: int = 0
    # Async (overlap) scheduling: one output placeholder per running request.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.encoder_cache_size < 0 or self.encoder_compute_budget < 0:
            raise ValueError("encoder_cache_size and encoder_compute_budget must be >= 0")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # Set explicitly (CPU, tests) or left None for the worker to size the KV
    # cache from memory (kv_cache_memory_bytes, or GPU free memory).
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # "sha256" (default, collision resistant) or "xxhash" (faster, opt-in).
    hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.hash_algo not in ("sha256", "xxhash"):
            raise ValueError(f"hash_algo must be 'sha256' or 'xxhash', got {self.hash_algo!r}")
