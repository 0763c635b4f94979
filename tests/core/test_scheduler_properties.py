"""Property test: random configs and random interleavings of add / abort /
step with random model outputs keep every scheduler invariant, every request
reads only its own KV (the KV oracle, through host-tier swaps and loads
too), replaying the KV events rebuilds each tier's cached hashes, and a run to
completion leaves every block and host slot free and no request behind."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenbudget.core import (
    ModelRunnerOutput,
    MultiModalFeature,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    CacheConfig,
    SchedulerOutput,
)
from tokenbudget.core.kv.events import DEVICE, HOST, KVEventReplayer

from .conftest import KVOracle

EOS = 0
VOCAB = 12  # small, so random prompts share prefixes and hit the cache
PAD = 99  # image placeholder token: equal for every image, told apart by mm_hash
# Each image has a fixed number of embeddings, as a real mm_hash would.
IMAGE_LENGTHS = {"img0": 5, "img1": 9, "img2": 20, "huge": 70}


@st.composite
def scheduler_configs(draw) -> tuple[SchedulerConfig, CacheConfig]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    spec = draw(st.sampled_from([0, 0, 1, 3]))
    max_model_len = draw(st.integers(24, 96))
    # Enough blocks for one request of max_model_len (plus its draft slots):
    # a smaller pool can never run such a request.
    min_blocks = -(-(max_model_len + spec) // block_size)
    num_blocks = 1 + min_blocks + draw(st.integers(0, min_blocks))
    sched = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(2, 96)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 16])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        encoder_compute_budget=draw(st.sampled_from([20, 32, 64])),
        encoder_cache_size=draw(st.sampled_from([20, 40, 64])),
        speculative_config={"method": "ngram", "num_speculative_tokens": spec} if spec else None,
    )
    cache = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=draw(st.booleans()),
        # The host tier: none, too small for most swaps, or roomy.
        num_offload_blocks=draw(st.sampled_from([None, 1, 4, 64, 64])),
        kv_load_blocks_per_step=draw(st.sampled_from([1, 3, 256])),
        enable_kv_cache_events=draw(st.booleans()),
    )
    return sched, cache


@st.composite
def requests(draw, request_id: str, max_model_len: int) -> Request:
    prefix = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5] * 2
    n_shared = draw(st.integers(0, len(prefix)))
    tail = draw(st.lists(st.integers(1, VOCAB - 1), max_size=40))
    prompt = (prefix[:n_shared] + tail)[:max_model_len] or [1]
    features = []
    pos = draw(st.integers(0, 10))
    for mm_hash in draw(st.lists(st.sampled_from(sorted(IMAGE_LENGTHS)), max_size=2)):
        length = IMAGE_LENGTHS[mm_hash]
        if pos + length > len(prompt):
            break
        prompt[pos : pos + length] = [PAD] * length
        features.append(MultiModalFeature(mm_hash, pos, length))
        pos += length + draw(st.integers(0, 6))
    max_tokens = draw(st.integers(1, 20))
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=1)),
    )
    return Request(
        request_id,
        prompt,
        params,
        eos_token_id=EOS,
        priority=draw(st.integers(0, 2)),
        arrival_time=float(request_id[1:]),
        mm_features=features,
        cache_salt=draw(st.sampled_from([None, None, "s"])),
    )


def random_model_output(s: Scheduler, so: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    sampled, drafts = [], []
    spec = s.scheduler_config.num_speculative_tokens
    for rid in req_ids:
        req = s.requests[rid]
        new: list[int] = []
        if req.num_computed_tokens >= req.num_tokens:  # prefill complete: sample
            scheduled = so.scheduled_spec_decode_tokens.get(rid, [])
            new = scheduled[: rng.randint(0, len(scheduled))]
            new.append(rng.randrange(VOCAB))
        sampled.append(new)
        drafts.append([rng.randrange(1, VOCAB) for _ in range(rng.randint(0, spec))] if new else [])
    return ModelRunnerOutput(
        req_ids,
        {r: i for i, r in enumerate(req_ids)},
        sampled,
        spec_token_ids=drafts if spec and rng.random() < 0.9 else None,
    )


def check_after_schedule(s: Scheduler, so: SchedulerOutput) -> None:
    cfg = s.scheduler_config
    s.kv_cache_manager.block_pool.check_invariants()
    s.kv_tiering.check_invariants()
    counts = so.num_scheduled_tokens
    assert so.total_num_scheduled_tokens == sum(counts.values()) <= cfg.max_num_batched_tokens
    assert all(n > 0 for n in counts.values())
    if cfg.long_prefill_token_threshold:
        assert max(counts.values(), default=0) <= cfg.long_prefill_token_threshold
    assert len(s.running) <= cfg.max_num_seqs
    running = {r.request_id for r in s.running}
    waiting = {r.request_id for r in s.waiting}
    assert len(running) == len(s.running) and len(waiting) == len(s.waiting)
    assert not running & waiting, "a request is both waiting and running"
    assert running | waiting == set(s.requests)
    assert set(counts) <= running, "a scheduled request is not running"
    assert not so.preempted_req_ids & set(counts)
    assert so.preempted_req_ids <= waiting
    assert set(s.kv_tiering.swapped) <= waiting, "a swapped request is not waiting"
    if so.preempted_req_ids:
        assert not so.scheduled_new_reqs and not so.scheduled_cached_reqs.resumed_token_ids
    assert not so.finished_req_ids & set(counts)
    block_size = s.cache_config.block_size
    for req in s.running:
        assert req.num_computed_tokens <= cfg.max_model_len
        num_blocks = len(s.kv_cache_manager.get_block_ids(req.request_id))
        assert num_blocks * block_size >= req.num_computed_tokens
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        req = s.requests[rid]
        # Spent once scheduled: a step scheduled before this one's output is
        # known must not verify them again.
        assert req.spec_token_ids == []
        # The drafts are the tail of what was scheduled: positions past num_tokens.
        assert req.num_computed_tokens - req.num_tokens == len(drafts)
    check_encoder_cache(s)


def check_encoder_cache(s: Scheduler) -> None:
    ecm = s.encoder_cache_manager
    used = sum(IMAGE_LENGTHS[h] for h in ecm.cached)
    assert ecm.num_free_slots >= 0
    assert ecm.num_free_slots + used == ecm.cache_size, "encoder cache slots leaked"
    assert set(ecm.freeable) == {h for h, refs in ecm.cached.items() if not refs}
    assert all(rid in s.requests for refs in ecm.cached.values() for rid in refs)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_random_workloads_keep_scheduler_invariants(data):
    sched_cfg, cache_cfg = data.draw(scheduler_configs(), label="config")
    s = Scheduler(sched_cfg, cache_cfg)
    rng = data.draw(st.randoms(use_true_random=False), label="model")
    streamed: dict[str, list[int]] = {}
    all_requests: dict[str, Request] = {}
    oracle = KVOracle(cache_cfg.block_size)
    aborted_swapped = False
    events = s.kv_tiering.events
    subscriber = events.subscribe(max_pending=1_000_000) if events is not None else None
    replayer = KVEventReplayer()

    def check_events() -> None:
        if subscriber is None:
            return
        while (batch := subscriber.get(timeout=0)) is not None:
            replayer.apply(batch)
        assert replayer.tiers[DEVICE] == set(s.kv_cache_manager.block_pool.cached)
        host = s.kv_tiering.host
        assert replayer.tiers[HOST] == (set(host.cached) if host is not None else set())

    def run_step() -> None:
        so = s.schedule()
        check_after_schedule(s, so)
        oracle.step(s, so)
        check_events()
        if so.is_empty:
            return
        for out in s.update_from_output(so, random_model_output(s, so, rng)):
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
        s.kv_cache_manager.block_pool.check_invariants()
        s.kv_tiering.check_invariants()
        check_encoder_cache(s)

    ops = data.draw(
        st.lists(
            st.sampled_from(["add", "add", "abort", "step", "step", "step"]),
            min_size=10,
            max_size=40,
        ),
        label="ops",
    )
    for op in ops:
        if op == "add":
            req = data.draw(requests(f"r{len(all_requests)}", sched_cfg.max_model_len))
            all_requests[req.request_id] = req
            limit = min(sched_cfg.encoder_cache_size, sched_cfg.encoder_compute_budget)
            if any(f.length > limit for f in req.mm_features):
                try:
                    s.add_request(req)
                except ValueError:
                    continue
                raise AssertionError("an image larger than the encoder cache was accepted")
            s.add_request(req)
        elif op == "abort" and all_requests:
            # Often a swapped request: its host slots must come back.
            swapped = sorted(s.kv_tiering.swapped)
            rid = data.draw(
                st.sampled_from(
                    swapped if swapped and data.draw(st.booleans()) else sorted(all_requests)
                ),
                label="abort",
            )
            aborted_swapped |= rid in s.kv_tiering.swapped
            was_live = rid in s.requests
            assert (s.finish_requests(rid, RequestStatus.FINISHED_ABORTED) == [rid]) == was_live
            assert rid not in s.requests
            s.kv_cache_manager.block_pool.check_invariants()
            s.kv_tiering.check_invariants()
        else:
            run_step()

    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        run_step()
    assert not s.has_unfinished_requests(), f"stuck: {list(s.requests.values())}"

    stats = s.make_stats()
    event(f"preempted: {bool(stats.num_preemptions)}")
    event(f"prefix hits: {bool(stats.prefix_cache_hits)}")
    event(f"encoder runs: {bool(s.encoder_cache_manager.num_encoder_runs)}")
    event(f"swapped out: {bool(stats.kv_swap_out_blocks)}")
    event(f"loaded from the host: {bool(stats.kv_swap_in_blocks)}")
    event(f"aborted while swapped: {aborted_swapped}")
    pool = s.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == cache_cfg.num_blocks - 1
    tiering = s.kv_tiering
    tiering.check_invariants()
    assert not tiering.swapped
    if tiering.host is not None:
        assert tiering.host.get_num_free_blocks() == tiering.host.num_usable, "host slots leaked"
    check_events()
    assert not s.running and not s.waiting and not s.kv_cache_manager.req_to_blocks
    assert all(not refs for refs in s.encoder_cache_manager.cached.values())
    for rid, req in all_requests.items():
        if req.status == RequestStatus.FINISHED_ABORTED:
            continue
        if req.status == RequestStatus.WAITING:
            continue  # rejected at add_request
        assert req.is_finished(), req
        # Each token streamed exactly once, preemptions notwithstanding.
        assert streamed.get(rid, []) == req.output_token_ids
        assert 1 <= req.num_output_tokens <= req.max_tokens
        # A prompt of exactly max_model_len tokens still samples one token
        # (from the logits of its last position); nothing past it is computed.
        assert req.num_tokens <= max(sched_cfg.max_model_len, req.num_prompt_tokens + 1)
