"""EngineStats: what AsyncEngine.get_stats reports (the scheduler's counts,
the KV cache's use, speculative decoding and the host KV tier), read from
the EngineCore on the engine thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.sched.stats import KVGroupUsage
    from tokenbudget.server.engine.core import EngineCore


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_requests: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    encoder_cache_usage: float
    num_generated_tokens: int
    healthy: bool
    # Speculative decoding (core/sched/stats.py), since start.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_mean_accepted_length: float = 0.0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # The host KV tier (SchedulerStats' fields of the same names).
    num_offload_blocks: int = 0
    offload_blocks_used: int = 0
    num_swapped_requests: int = 0
    num_recomputed_tokens: int = 0
    kv_swap_out_blocks: int = 0
    kv_swap_in_blocks: int = 0
    # KV use per cache group (window, blocks held), in group order.
    kv_groups: list[KVGroupUsage] = field(default_factory=list)


def make_engine_stats(
    core: EngineCore, num_requests: int, num_generated_tokens: int, healthy: bool
) -> EngineStats:
    """``core``'s stats now; the engine's live requests (``num_requests``),
    tokens generated since start and health come from the AsyncEngine."""
    s = core.stats()
    return EngineStats(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_requests=num_requests,
        kv_cache_usage=s.kv_cache_usage,
        num_free_blocks=core.num_free_blocks(),
        num_total_blocks=core.cache_config.num_blocks - 1,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions,
        encoder_cache_usage=s.encoder_cache_usage,
        num_generated_tokens=num_generated_tokens,
        healthy=healthy,
        spec_num_drafts=s.spec_decoding.num_drafts,
        spec_num_draft_tokens=s.spec_decoding.num_draft_tokens,
        spec_num_accepted_tokens=s.spec_decoding.num_accepted_tokens,
        spec_mean_accepted_length=s.spec_decoding.mean_accepted_length,
        spec_accepted_per_position=s.spec_decoding.accepted_per_position,
        num_offload_blocks=s.num_offload_blocks,
        offload_blocks_used=s.offload_blocks_used,
        num_swapped_requests=s.num_swapped_requests,
        num_recomputed_tokens=s.num_recomputed_tokens,
        kv_swap_out_blocks=s.kv_swap_out_blocks,
        kv_swap_in_blocks=s.kv_swap_in_blocks,
        kv_groups=s.kv_groups,
    )
