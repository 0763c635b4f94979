"""The operator's log lines: the periodic stats line and one line per finished
request (server/engine/stats_logger.py, fed through EngineMetrics's hooks)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import pytest

from tokenbudget.server.engine.metrics import EngineMetrics


@dataclass
class Stats:  # the fields of async_engine.EngineStats the line and the gauges read
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    encoder_cache_usage: float = 0.0
    num_generated_tokens: int = 0
    healthy: bool = True
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_mean_accepted_length: float = 0.0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    num_offload_blocks: int = 0
    offload_blocks_used: int = 0
    num_swapped_requests: int = 0
    num_recomputed_tokens: int = 0
    kv_swap_out_blocks: int = 0
    kv_swap_in_blocks: int = 0


@dataclass
class Timing:
    arrival: float
    first_token: float | None
    num_tokens: int


@pytest.fixture
def metrics():
    m = EngineMetrics("tiny")  # log_interval 0: no thread; the test calls log() itself
    yield m
    m.close()


def test_stats_line_gives_the_intervals_throughput_and_counts_and_the_current_gauges(metrics):
    logger = metrics.stats_logger
    logger.log(now=100.0)  # the start of the interval
    metrics.observe_tokens(300)
    metrics.observe_tokens(200)
    metrics.observe_finished(Timing(100.5, 100.6, 250), 102.0)
    metrics.observe_engine(
        Stats(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.4125,
            prefix_cache_queries=400,
            prefix_cache_hits=100,
            num_preemptions=1,
        )
    )
    assert logger.log(now=110.0) == (
        "Avg generation throughput: 50.0 tokens/s, Running: 3 reqs, Waiting: 2 reqs, "
        "KV cache usage: 41.2%, Prefix cache hit rate: 25.0%, Finished: 1 reqs, "
        "Preemptions: 1"
    )


def test_stats_line_appends_draft_acceptance_with_speculative_decoding(metrics):
    logger = metrics.stats_logger
    logger.log(now=0.0)
    metrics.observe_tokens(10)
    metrics.observe_engine(
        Stats(
            num_running=1,
            spec_num_drafts=4,
            spec_num_draft_tokens=16,
            spec_num_accepted_tokens=6,
            spec_mean_accepted_length=2.5,
            spec_accepted_per_position=[4, 2],
        )
    )
    assert logger.log(now=10.0).endswith(
        "Preemptions: 0, Draft acceptance rate: 37.5%, Mean accepted length: 2.50"
    )


def test_stats_line_is_written_once_more_after_the_engine_drains_then_stays_quiet(metrics):
    logger = metrics.stats_logger
    logger.log(now=0.0)
    assert logger.log(now=10.0) is None  # nothing ever happened
    metrics.observe_tokens(10)
    metrics.observe_engine(Stats(num_running=1))
    assert "Running: 1 reqs" in logger.log(now=20.0)
    metrics.observe_engine(Stats())  # went idle between two lines
    assert logger.log(now=30.0).startswith(
        "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs"
    )
    assert logger.log(now=40.0) is None
    metrics.observe_tokens(5)  # a short burst that finished between two lines
    assert "Avg generation throughput: 0.5 tokens/s, Running: 0 reqs" in logger.log(now=50.0)
    assert logger.log(now=60.0) is None


def test_periodic_line_is_logged_at_info_by_its_own_thread(caplog):
    caplog.set_level(logging.INFO, logger="tokenbudget.server.stats")
    m = EngineMetrics("tiny", log_interval=0.02)
    try:
        m.observe_tokens(7)
        m.observe_engine(Stats(num_running=1))
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        m.close()
    assert caplog.records and caplog.records[0].levelno == logging.INFO
    assert "Running: 1 reqs" in caplog.records[0].getMessage()


def test_a_finished_request_gets_one_debug_line_with_its_latencies(metrics, caplog):
    caplog.set_level(logging.DEBUG, logger="tokenbudget.server.stats")
    metrics.observe_finished(
        Timing(10.0, 10.25, 11),
        11.25,
        request_id="req-7",
        num_prompt_tokens=42,
        finish_reason="length",
    )
    metrics.observe_finished(Timing(10.0, None, 0), 10.5)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.DEBUG,
            "request req-7 finished (length): prompt 42 tokens, output 11 tokens, "
            "TTFT 250.0 ms, TPOT 100.0 ms, e2e 1.250 s",
        ),
        (logging.DEBUG, "request finished: output 0 tokens, e2e 0.500 s"),
    ]


def test_no_request_line_above_debug_level(metrics, caplog):
    caplog.set_level(logging.INFO, logger="tokenbudget.server.stats")
    metrics.observe_finished(Timing(10.0, 10.25, 11), 11.25)
    assert caplog.records == []


def test_host_kv_tier_gauges_and_counters_follow_the_engine_stats(metrics):
    value = metrics.registry.get_sample_value
    labels = {"model_name": "tiny"}
    metrics.observe_engine(
        Stats(
            num_offload_blocks=64,
            offload_blocks_used=10,
            num_swapped_requests=2,
            num_recomputed_tokens=5,
            kv_swap_out_blocks=12,
            kv_swap_in_blocks=3,
        )
    )
    metrics.observe_engine(
        Stats(
            num_offload_blocks=64,
            offload_blocks_used=4,
            num_recomputed_tokens=7,
            kv_swap_out_blocks=12,
            kv_swap_in_blocks=9,
        )
    )
    assert value("tokenbudget:kv_offload_blocks_used", labels) == 4
    assert value("tokenbudget:kv_offload_blocks_free", labels) == 60
    assert value("tokenbudget:num_requests_swapped", labels) == 0
    assert value("tokenbudget:num_recomputed_tokens_total", labels) == 7
    assert value("tokenbudget:kv_swap_out_blocks_total", labels) == 12
    assert value("tokenbudget:kv_swap_in_blocks_total", labels) == 9
