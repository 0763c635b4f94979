"""Scheduler and cache configuration: one dataclass per concern.

Each engine setting is declared once, here or in EngineArgs, with ``setting``:
its default, its help text and the ``server --help`` group of its flag. The
``server`` flags, the ``LLM(...)`` keywords (server/engine/args.py) and the
worker.proto field lists (proto/convert.py) are derived from these fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from tokenbudget.core.spec_config import SpeculativeConfig

# CacheConfig.kv_transfer_backend values ("": no KV transfer).
KV_TRANSFER_BACKENDS = ("", "nixl", "mooncake")
POLICIES = ("fcfs", "priority", "lpm", "dfs-weight", "lof", "random", "slo")
# The ``server --help`` groups of the settings declared here.
SCHEDULER = "scheduler"
POLICY = "scheduling policy (SGLang-style)"
KV_CACHE = "KV cache"
# A model's context limit unless max_model_len says otherwise (EngineArgs: at most this).
DEFAULT_MAX_MODEL_LEN = 8192


def setting(default: Any, help: str, *, group: str, **flag: Any) -> Any:
    """A dataclass field that is an engine setting: its default, and in its
    metadata the help text and group of its flag, plus what its type does not
    say: ``choices``, ``metavar``, ``flags`` (more option strings), ``parse``
    (text -> value, raising ValueError) and ``engine_default`` (the default
    of EngineArgs, where a config built by hand keeps another one)."""
    return field(default=default, metadata={"help": help, "group": group, **flag})


def parse_tenant_weights(text: str) -> dict[str, float]:
    """--tenant-weights: a JSON object of tenant -> weight."""
    try:
        weights = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(weights, dict) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights.values()
    ):
        raise ValueError('expected a JSON object of numbers, e.g. {"a": 2}')
    return {str(k): float(w) for k, w in weights.items()}


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = setting(
        8192,
        "token budget of one step, prefill chunks and decodes together (default %(default)s)",
        group=SCHEDULER,
    )
    max_num_seqs: int = setting(
        256, "most requests running at once (default %(default)s)", group=SCHEDULER
    )
    max_model_len: int = setting(
        DEFAULT_MAX_MODEL_LEN,
        "prompt + output limit per request; a request's max_tokens "
        "beyond what its prompt leaves is clamped to it (default: the model's, at most "
        f"{DEFAULT_MAX_MODEL_LEN}, or its sliding window)",
        group=SCHEDULER,
    )
    long_prefill_token_threshold: int = setting(
        0, "cap one request's prefill chunk per step; 0 = no cap (default)", group=SCHEDULER
    )
    policy: str = setting(
        "fcfs",
        "waiting-queue order (default %(default)s; --scheduling-policy is vLLM's name, "
        "which has fcfs and priority; slo orders by the requests' TTFT deadlines)",
        group=SCHEDULER,
        choices=POLICIES,
    )
    # Encoder (vision) compute budget per step and cache capacity, in embeddings.
    encoder_compute_budget: int = setting(
        8192, "vision encoder embeddings computed per step (default %(default)s)", group=SCHEDULER
    )
    encoder_cache_size: int = setting(
        8192,
        "vision encoder embeddings kept for requests that still need them (default %(default)s)",
        group=SCHEDULER,
    )
    # Speculative decoding (None: off); a dict or its JSON text is parsed.
    speculative_config: SpeculativeConfig | None = setting(
        None,
        'speculative decoding, as in vLLM: a JSON object such as \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
        "(n-gram prompt lookup, the one method here; drafts are verified so outputs keep the "
        "model's distribution). Default: off",
        group=SCHEDULER,
        metavar="JSON",
    )
    # Async (overlap) scheduling: one output placeholder per running request.
    # On for EngineArgs (server and LLM); a SchedulerConfig built by hand
    # drives EngineCore's synchronous loop, as tests and the simulator expect.
    async_scheduling: bool = setting(
        False,
        "schedule step N+1 while step N runs (the default, for server and LLM alike: "
        "the same tokens, and the worker never waits for the scheduler; with "
        "--speculative-config, steps verifying drafts run alone); --no-async-scheduling "
        "schedules step N+1 only after step N returned",
        group=SCHEDULER,
        engine_default=True,
    )
    # -- SGLang-style policies (core/policy/cache_aware.py) --
    priority_descending: bool = setting(
        False, "--policy priority: higher values run first (default: lower first)", group=POLICY
    )
    lpm_fallback_queue_len: int = setting(
        128,
        "lpm orders by cached prefix only while at most this many wait, else falls back "
        "to FCFS (default %(default)s)",
        group=POLICY,
    )
    # The rest wait behind the window in FCFS order, bounding dfs-weight's per-step cost.
    cache_aware_window: int = setting(
        128,
        "dfs-weight orders this many requests at the head of the queue (default %(default)s)",
        group=POLICY,
    )
    # lpm, dfs-weight: a request meeting both thresholds waits a round.
    in_batch_prefix_check_threshold: int = setting(
        32,
        "in-batch prefix deprioritisation applies to requests with at most this many "
        "cached tokens; 0 disables (default %(default)s)",
        group=POLICY,
    )
    in_batch_prefix_deprioritize_threshold: int = setting(
        32,
        "...and sharing at least this many tokens with one chosen earlier in the round "
        "(default %(default)s)",
        group=POLICY,
    )
    aging_bound_s: float = setting(
        30.0,
        "cache-aware policies and slo: requests waiting longer than this go first, in "
        "arrival order; 0 disables (default %(default)s)",
        group=POLICY,
    )
    random_seed: int = setting(0, "seed of --policy random", group=POLICY)
    # SGLang's new_token_ratio.
    admission_reserve: bool | None = setting(
        None,
        "reserve KV for running requests' expected output when admitting "
        "(default: on for lpm/dfs-weight/lof/random, off for fcfs/priority, vLLM's "
        "behaviour); --no-admission-reserve admits on the KV blocks free now",
        group=POLICY,
    )
    init_new_token_ratio: float = setting(
        0.7,
        "admission reserve: the fraction of running requests' remaining max_tokens "
        "reserved at first (default %(default)s)",
        group=POLICY,
    )
    min_new_token_ratio: float = setting(
        0.1, "admission reserve: the floor the ratio decays to (default %(default)s)", group=POLICY
    )
    new_token_ratio_decay: float = setting(
        0.001,
        "admission reserve: decay of the ratio per step without preemption (default %(default)s)",
        group=POLICY,
    )
    reserve_clip_tokens: int = setting(
        4096,
        "admission reserve: at most this many tokens reserved per running request "
        "(default %(default)s)",
        group=POLICY,
    )
    preemption_mode: str = setting(
        "vllm",
        "victim on memory shortage: vllm (last admitted / worst priority) or retract "
        "(SGLang: fewest generated tokens, then longest prompt) (default %(default)s)",
        group=POLICY,
        choices=("vllm", "retract"),
    )
    priority_preemption_threshold: int = setting(
        10,
        "--policy priority: a waiting request may preempt running ones whose priority is "
        "worse by more than this; negative disables (default %(default)s)",
        group=POLICY,
    )
    max_queued_requests: int = setting(
        0,
        "waiting requests beyond this are refused with RESOURCE_EXHAUSTED; with --policy "
        "priority the worst queued one is evicted for a strictly better newcomer (default 0: "
        "unlimited)",
        group=POLICY,
    )
    # -- SLO-aware (core/policy/slo.py) and fair-share (core/policy/fair_share.py) --
    slo_reject_late: bool = setting(
        False,
        '--policy slo: refuse (finish "abort") a waiting request that cannot get its '
        "first token by its ttft_ms deadline, instead of letting it wait behind the ones that "
        "can (until --aging-bound-s)",
        group=POLICY,
    )
    # An EWMA of the measured steps when 0.
    slo_step_time_ms: float = setting(
        0.0,
        "--policy slo: step time for the deadline estimates; 0 learns it from the steps (default)",
        group=POLICY,
    )
    fair_share: bool = setting(
        False,
        "share the token budget between tenants (GenerateRequest.tenant) by weight, so "
        "one tenant's flood cannot starve another (not with --policy priority)",
        group=POLICY,
    )
    tenant_weights: dict[str, float] | None = setting(
        None,
        '--fair-share weights, e.g. \'{"gold": 4, "free": 1}\' (a tenant not listed weighs 1)',
        group=POLICY,
        metavar="JSON",
        parse=parse_tenant_weights,
    )
    # Not work conserving: the share the others leave unused stays unused that step.
    fair_share_chunk_cap: bool = setting(
        True,
        "--fair-share: while other tenants have work, cap a tenant's prompt tokens per "
        "step at its weighted share of --max-num-batched-tokens, so its long prefills do not "
        "slow the others' decodes (default on)",
        group=POLICY,
    )

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
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.preemption_mode not in ("vllm", "retract"):
            raise ValueError(
                f"preemption_mode must be 'vllm' or 'retract', got {self.preemption_mode!r}"
            )
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.fair_share and self.policy == "priority":
            raise ValueError(
                "fair_share does not combine with policy 'priority' "
                "(a priority queue has its own order)"
            )
        for tenant, weight in (self.tenant_weights or {}).items():
            if not weight > 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be > 0, got {weight}")
        if self.slo_step_time_ms < 0:
            raise ValueError(f"slo_step_time_ms must be >= 0, got {self.slo_step_time_ms}")
        if self.encoder_cache_size < 0 or self.encoder_compute_budget < 0:
            raise ValueError("encoder_cache_size and encoder_compute_budget must be >= 0")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


# SchedulerConfig fields of the SGLang-style policies, flags and LLM(...)
# keywords under the same names (EngineArgs.policy_options).
POLICY_OPTIONS = tuple(f.name for f in fields(SchedulerConfig) if f.metadata["group"] == POLICY)


@dataclass(slots=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block (default %(default)s)", group=KV_CACHE)
    # Set explicitly (CPU, tests) or left None for the worker to size the KV
    # cache from memory (kv_cache_memory_bytes, or GPU free memory).
    num_blocks: int | None = setting(
        None, "KV blocks to allocate (overrides memory-based sizing)", group=KV_CACHE
    )
    enable_prefix_caching: bool = setting(
        True, "reuse KV blocks across requests with the same prefix (default on)", group=KV_CACHE
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "KV cache size, e.g. 2GiB or 512MB (default on CPU: 1GiB, or less when "
        "--max-num-seqs sequences at --max-model-len need less; on a GPU: what "
        "--gpu-memory-utilization leaves free after a profile run)",
        group=KV_CACHE,
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "fraction of GPU memory for weights + activations + KV (default %(default)s)",
        group=KV_CACHE,
    )
    hash_algo: str = setting(
        "sha256",
        "prefix-cache block hash: sha256 (default, collision resistant) or xxhash "
        "(faster, not collision resistant, so seeded: see --hash-seed; pip install "
        "'tokenbudget[fast-hash]')",
        group=KV_CACHE,
        choices=("sha256", "xxhash"),
    )
    # sha256 takes no seed.
    hash_seed: int | None = setting(
        None,
        "seed of the xxhash block hash (default: random per process, so clients cannot "
        "precompute colliding prompts; set it for hashes that agree across processes and "
        "restarts); sha256 ignores it",
        group=KV_CACHE,
    )
    # Host-memory KV tier (core/kv/tiering.py): its size in bytes, or in blocks
    # (num_offload_blocks wins; the worker fills it in from the bytes). Off when
    # both are None or 0.
    kv_offload_memory_bytes: int | None = setting(
        None,
        "host-memory KV tier, e.g. 8GiB (pinned on a GPU machine): preempted requests "
        "swap their KV there instead of recomputing it, and prefix blocks evicted from the "
        "device cache spill there (default: off)",
        group=KV_CACHE,
    )
    num_offload_blocks: int | None = setting(
        None, "host KV tier size in blocks (overrides --kv-offload-memory)", group=KV_CACHE
    )
    kv_load_blocks_per_step: int = setting(
        256,
        "at most this many blocks copied from the host tier to the device per step "
        "(default %(default)s; one request needing more loads alone)",
        group=KV_CACHE,
    )
    # Off by default: the bookkeeping costs a little per block.
    enable_kv_cache_events: bool = setting(
        False,
        "publish KV cache events (core/kv/events.py: block stored/removed per tier, "
        "all cleared) on the SubscribeKvEvents stream (default off)",
        group=KV_CACHE,
    )
    # Not a setting: the attention window of each KV cache group of the model
    # (0: full attention), as the workers report it (KVCacheSpec); () is one
    # full-attention group. See core/kv/groups.py.
    kv_group_windows: tuple[int, ...] = field(default=(), metadata={"derived": True})
    # Not a setting: the KV transfer library the workers register their KV
    # cache with for disaggregated prefill/decode ("": none); the engine
    # factory sets it from the disaggregation flags.
    kv_transfer_backend: str = field(default="", metadata={"derived": True})

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("kv_offload_memory_bytes", "num_offload_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_load_blocks_per_step < 1:
            raise ValueError(
                f"kv_load_blocks_per_step must be >= 1, got {self.kv_load_blocks_per_step}"
            )
        if self.hash_algo not in ("sha256", "xxhash"):
            raise ValueError(f"hash_algo must be 'sha256' or 'xxhash', got {self.hash_algo!r}")
        if self.hash_seed is not None and not 0 <= self.hash_seed < 1 << 64:
            raise ValueError(f"hash_seed must be in [0, 2**64), got {self.hash_seed}")
        if self.kv_transfer_backend not in KV_TRANSFER_BACKENDS:
            raise ValueError(
                "kv_transfer_backend must be '', 'nixl' or 'mooncake', "
                f"got {self.kv_transfer_backend!r}"
            )
