"""Scheduler and cache configuration: one dataclass per concern."""
from __future__ import annotations

from dataclasses import dataclass

from tokenbudget.core.spec_config import SpeculativeConfig

POLICIES = ("fcfs", "priority", "lpm", "dfs-weight", "lof", "random", "slo")
# SchedulerConfig fields of the SGLang-style policies, exposed as CLI flags and
# LLM(...) keyword arguments under the same names.
POLICY_OPTIONS = (
    "priority_descending", "lpm_fallback_queue_len", "cache_aware_window",
    "in_batch_prefix_check_threshold", "in_batch_prefix_deprioritize_threshold",
    "aging_bound_s", "random_seed", "admission_reserve", "init_new_token_ratio",
    "min_new_token_ratio", "new_token_ratio_decay", "reserve_clip_tokens", "preemption_mode",
    "priority_preemption_threshold", "max_queued_requests",
    "slo_reject_late", "slo_step_time_ms", "fair_share", "tenant_weights",
    "fair_share_chunk_cap",
)


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
    # Speculative decoding (None: off); a dict or its JSON text is parsed.
    speculative_config: SpeculativeConfig | None = None
    # Async (overlap) scheduling: one output placeholder per running request.
    async_scheduling: bool = False
    # -- SGLang-style policies (core/policy/cache_aware.py) --
    # priority: by default lower values run first; True flips that.
    priority_descending: bool = False
    # lpm falls back to FCFS when more requests than this wait.
    lpm_fallback_queue_len: int = 128
    # dfs-weight orders only this many requests at the head of the queue (the
    # rest wait behind them in FCFS order), bounding its per-step cost.
    cache_aware_window: int = 128
    # In-batch prefix deprioritisation (lpm, dfs-weight): requests whose cached
    # prefix is <= check tokens and that share >= deprioritize tokens with one
    # already chosen this round wait a round. 0 disables.
    in_batch_prefix_check_threshold: int = 32
    in_batch_prefix_deprioritize_threshold: int = 32
    # Cache-aware policies and slo serve requests waiting longer than this
    # (seconds) first, in arrival order. 0 disables aging.
    aging_bound_s: float = 30.0
    random_seed: int = 0
    # Reserve KV for running requests' future tokens when admitting (SGLang's
    # new_token_ratio). None: on for lpm/dfs-weight/lof/random, off for
    # fcfs/priority (vLLM behaviour).
    admission_reserve: bool | None = None
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    reserve_clip_tokens: int = 4096
    # Victim on memory shortage: "vllm" (last admitted / worst priority) or
    # "retract" (SGLang: fewest generated tokens, then longest prompt).
    preemption_mode: str = "vllm"
    # policy=priority: a waiting request may preempt running requests whose
    # priority is worse by more than this. A negative value disables it.
    priority_preemption_threshold: int = 10
    # Waiting requests beyond this are rejected (or, with priority, the worst
    # queued one is evicted for a strictly better newcomer). 0: unlimited.
    max_queued_requests: int = 0
    # -- SLO-aware and fair-share scheduling (core/policy/slo.py) --
    # policy=slo: a waiting request that cannot reach its first token by its
    # TTFT deadline is refused (finished "abort") instead of queued behind the
    # ones that can. False: it only waits behind them (until aging_bound_s).
    slo_reject_late: bool = False
    # policy=slo: the step time used to estimate when a queued request would get
    # its first token; 0 learns it from the steps (an EWMA).
    slo_step_time_ms: float = 0.0
    # Weighted fair share between tenants (Request.tenant): admission order
    # gives each tenant scheduled tokens in proportion to its weight (default
    # 1.0 for a tenant not listed). Works with every policy but priority.
    fair_share: bool = False
    tenant_weights: dict[str, float] | None = None
    # fair_share: while other tenants have work, a tenant's prompt tokens in one
    # step are capped at its weighted share of max_num_batched_tokens, so its
    # long prefills cannot stretch the step (and the others' decodes). Not work
    # conserving: the share the others leave unused stays unused that step.
    fair_share_chunk_cap: bool = True

    @property
    def num_speculative_tokens(self) -> int:
        """Draft slots per request and step (0: no speculative decoding)."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def use_admission_reserve(self) -> bool:
        if self.admission_reserve is None:
            return self.policy not in ("fcfs", "priority")
        return self.admission_reserve

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.preemption_mode not in ("vllm", "retract"):
            raise ValueError("preemption_mode must be 'vllm' or 'retract', got "
                             f"{self.preemption_mode!r}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.fair_share and self.policy == "priority":
            raise ValueError("fair_share does not combine with policy 'priority' "
                             "(a priority queue has its own order)")
        for tenant, weight in (self.tenant_weights or {}).items():
            if not weight > 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be > 0, got {weight}")
        if self.slo_step_time_ms < 0:
            raise ValueError(f"slo_step_time_ms must be >= 0, got {self.slo_step_time_ms}")
        if self.encoder_cache_size < 0 or self.encoder_compute_budget < 0:
            raise ValueError("encoder_cache_size and encoder_compute_budget must be >= 0")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


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
    # Seeds xxhash (sha256 takes no seed): None draws one per process at random,
    # so nobody can precompute colliding prompts; set it for hashes that
    # agree across processes and restarts.
    hash_seed: int | None = None
    # Host-memory KV tier (core/kv/tiering.py): its size in bytes, or in blocks
    # (num_offload_blocks wins; the worker fills it in from the bytes). Off when
    # both are None or 0.
    kv_offload_memory_bytes: int | None = None
    num_offload_blocks: int | None = None
    # Blocks copied from the host tier into the device cache per step, at most
    # (one request needing more still loads, alone in its step).
    kv_load_blocks_per_step: int = 256
    # Publish KV cache events (core/kv/events.py): block stored / removed per
    # tier, all cleared. Off by default: the bookkeeping costs a little per block.
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        for name in ("kv_offload_memory_bytes", "num_offload_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_load_blocks_per_step < 1:
            raise ValueError("kv_load_blocks_per_step must be >= 1, got "
                             f"{self.kv_load_blocks_per_step}")
        if self.hash_algo not in ("sha256", "xxhash"):
            raise ValueError(f"hash_algo must be 'sha256' or 'xxhash', got {self.hash_algo!r}")
        if self.hash_seed is not None and not 0 <= self.hash_seed < 1 << 64:
            raise ValueError(f"hash_seed must be in [0, 2**64), got {self.hash_seed}")
