"""The scheduler's statistics (``Scheduler.make_stats``), and the counters of
speculative decoding, kept as drafts are verified."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Since start: verification steps with drafts (``num_drafts``), draft tokens
    verified and accepted, and per draft position how often it was accepted
    (position i is accepted only if positions 0..i-1 were)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        if len(per_position) < num_accepted:
            per_position.extend([0] * (num_accepted - len(per_position)))
        for i in range(num_accepted):
            per_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts plus the
        token sampled after them (vLLM's "mean acceptance length"); 0 before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )


@dataclass(slots=True)
class KVGroupUsage:
    """One KV cache group's share of the pool: its window (0: full attention)
    and the blocks its requests hold now."""

    window: int
    num_blocks_used: int


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    encoder_cache_usage: float
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    # The host KV tier (core/kv/tiering.py); zeros without one.
    num_offload_blocks: int = 0
    offload_blocks_used: int = 0
    num_swapped_requests: int = 0
    # Tokens computed again after a preemption had thrown their KV away.
    num_recomputed_tokens: int = 0
    kv_swap_out_blocks: int = 0
    kv_swap_in_blocks: int = 0
    # One entry per KV cache group, in group order (core/kv/groups.py).
    kv_groups: list[KVGroupUsage] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0
