"""What the engine thread reports, as Prometheus metrics (``server
--metrics-port``) and log lines (server/engine/stats_logger.py).

Names follow vLLM's where one exists, with a ``tokenbudget:`` prefix. Engine
gauges are refreshed at most every ``interval`` seconds: making the stats
walks the scheduler, and a scrape does not need per-step resolution.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tokenbudget.server.engine.stats_logger import StatsLogger

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)

# (attribute, metric name, help)
_GAUGES = (
    ("running", "num_requests_running", "Requests in the running batch."),
    ("waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
    ("kv_usage", "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
    (
        "prefix_hit_rate",
        "prefix_cache_hit_rate",
        "Prefix cache hits / queries, in tokens, since start.",
    ),
    (
        "offload_used",
        "kv_offload_blocks_used",
        "Host KV tier blocks holding KV (swapped or cached).",
    ),
    ("offload_free", "kv_offload_blocks_free", "Host KV tier blocks holding none."),
    ("swapped", "num_requests_swapped", "Preempted requests whose KV waits in the host tier."),
    (
        "spec_mean_length",
        "spec_decode_mean_accepted_length",
        "Tokens per verification step (accepted drafts + 1), since start.",
    ),
)
# (attribute, metric name, help, the engine stats' running total that feeds it, if one)
# Speculative decoding uses vLLM's spec_decode_* names.
_COUNTERS = (
    ("prefix_queries", "prefix_cache_queries", "Prompt tokens looked up.", "prefix_cache_queries"),
    (
        "prefix_hits",
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits",
    ),
    (
        "preemptions",
        "num_preemptions",
        "Requests preempted (KV recomputed or swapped out).",
        "num_preemptions",
    ),
    ("generation_tokens", "generation_tokens", "Tokens generated.", None),
    (
        "recomputed",
        "num_recomputed_tokens",
        "Tokens computed again after a preemption dropped their KV.",
        "num_recomputed_tokens",
    ),
    ("swap_out", "kv_swap_out_blocks", "KV blocks copied device -> host.", "kv_swap_out_blocks"),
    ("swap_in", "kv_swap_in_blocks", "KV blocks copied host -> device.", "kv_swap_in_blocks"),
    ("spec_drafts", "spec_decode_num_drafts", "Verification steps with drafts.", "spec_num_drafts"),
    (
        "spec_draft_tokens",
        "spec_decode_num_draft_tokens",
        "Draft tokens verified.",
        "spec_num_draft_tokens",
    ),
    (
        "spec_accepted",
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
        "spec_num_accepted_tokens",
    ),
)
_HISTOGRAMS = (
    ("ttft", "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS),
    (
        "tpot",
        "time_per_output_token_seconds",
        "Mean time between output tokens of a request.",
        _TPOT_BUCKETS,
    ),
    ("e2e", "e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS),
)


class EngineMetrics:
    """The engine's observer (AsyncEngine calls the hooks below on its
    thread). ``log_interval`` > 0 also logs a stats line that often
    (StatsLogger); call ``close()`` when the engine is done."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        interval: float = 0.25,
        log_interval: float = 0.0,
        log_requests: bool = False,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.interval = interval
        self.stats_logger = StatsLogger(log_interval, log_requests=log_requests)
        self._last = 0.0
        r, labels = self.registry, ["model_name"]
        for attr, name, doc in _GAUGES:
            setattr(
                self, attr, Gauge(f"tokenbudget:{name}", doc, labels, registry=r).labels(model_name)
            )
        for attr, name, doc, _ in _COUNTERS:
            setattr(
                self,
                attr,
                Counter(f"tokenbudget:{name}", doc, labels, registry=r).labels(model_name),
            )
        for attr, name, doc, buckets in _HISTOGRAMS:
            setattr(
                self,
                attr,
                Histogram(f"tokenbudget:{name}", doc, labels, buckets=buckets, registry=r).labels(
                    model_name
                ),
            )
        # The stats' running totals already counted, per counter fed from them.
        self._seen: dict[str, int] = {attr: 0 for attr, _, _, field in _COUNTERS if field}
        self._spec_per_position = Counter(
            "tokenbudget:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            ["model_name", "position"],
            registry=r,
        )
        self._model_name = model_name
        self._seen_per_position: list[int] = []

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on ``port`` (0: one the OS picks); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def close(self) -> None:
        self.stats_logger.close()

    # -- hooks called by the engine thread ----------------------------------------------
    def observe_tokens(self, n: int) -> None:
        if n:
            self.generation_tokens.inc(n)
            self.stats_logger.record_tokens(n)

    def observe_finished(self, timing, now: float, **request: Any) -> None:
        """``request``: optional request_id, num_prompt_tokens, finish_reason
        for the debug line (StatsLogger.record_finished)."""
        self.stats_logger.record_finished(timing, now, **request)
        self.e2e.observe(now - timing.arrival)
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - timing.arrival)
            if timing.num_tokens > 1:
                self.tpot.observe((now - timing.first_token) / (timing.num_tokens - 1))

    def maybe_observe_engine(self, make_stats: Callable[[], Any]) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        self.observe_engine(make_stats())

    def observe_engine(self, stats) -> None:
        self.stats_logger.record_engine(stats)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self.offload_used.set(stats.offload_blocks_used)
        self.offload_free.set(stats.num_offload_blocks - stats.offload_blocks_used)
        self.swapped.set(stats.num_swapped_requests)
        for attr, _, _, field in _COUNTERS:
            if not field:
                continue
            value = getattr(stats, field)
            if value < self._seen[attr]:  # a fresh scheduler (workers reconnected) counts from 0
                self._seen[attr] = 0
            if value > self._seen[attr]:
                getattr(self, attr).inc(value - self._seen[attr])
                self._seen[attr] = value
        self.spec_mean_length.set(stats.spec_mean_accepted_length)
        seen = self._seen_per_position
        for position, value in enumerate(stats.spec_accepted_per_position):
            if position == len(seen):
                seen.append(0)
            if value < seen[position]:  # a fresh scheduler counts from 0
                seen[position] = 0
            if value > seen[position]:
                self._spec_per_position.labels(self._model_name, str(position)).inc(
                    value - seen[position]
                )
                seen[position] = value
