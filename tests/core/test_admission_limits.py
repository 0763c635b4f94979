"""Requests that could never run are refused up front; a request that waits
holds nothing."""

from __future__ import annotations

import pytest


def test_prompt_larger_than_the_whole_kv_cache_is_rejected(make_scheduler, make_request):
    sched = make_scheduler(num_blocks=3, block_size=4)  # 2 usable blocks: 8 tokens
    with pytest.raises(ValueError, match="KV cache holds only 8"):
        sched.add_request(make_request("big", 20))
    sched.add_request(make_request("ok", 8))
    assert list(sched.requests) == ["ok"]


def test_waiting_request_that_cannot_get_blocks_pins_no_encoder_entry(
    make_scheduler, make_request, step
):
    # "hog" holds most blocks; "img" needs an image that is already cached
    # (freeable) but cannot get its KV blocks, so it must not reference it.
    sched = make_scheduler(
        num_blocks=9, block_size=4, encoder_cache_size=16, encoder_compute_budget=16
    )
    sched.add_request(make_request("first", 12, mm=[("cat", 2, 8)], max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    ecm = sched.encoder_cache_manager
    assert "cat" in ecm.freeable
    sched.add_request(make_request("hog", 24, max_tokens=8))
    step(sched)
    sched.add_request(make_request("img", 20, mm=[("cat", 4, 8)]))
    so, _ = step(sched)
    assert "img" not in so.num_scheduled_tokens
    assert ecm.cached["cat"] == set() and "cat" in ecm.freeable


def test_refused_request_is_never_registered_with_the_grammar_manager(make_request):
    from tokenbudget.core import CacheConfig, Scheduler, SchedulerConfig
    from tokenbudget.core.failures import QueueFullError

    class RecordingManager:
        def __init__(self) -> None:
            self.added: list[str] = []

        def add_request(self, request) -> None:
            self.added.append(request.request_id)

    som = RecordingManager()
    sched = Scheduler(SchedulerConfig(max_queued_requests=1), CacheConfig(num_blocks=64), som)
    structured = {"regex": "[0-9]+"}
    sched.add_request(make_request("a", 8, structured=structured))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("b", 8, structured=structured))
    assert som.added == ["a"]
