"""The scheduler's LoRA rules: at most max_loras distinct adapters among the
requests of a step (the worker's device slots), requests of an adapter that
would be one too many wait without losing their place, and cached prefixes
are shared only within one adapter."""

from __future__ import annotations

import pytest

from tokenbudget.core import CacheConfig, LoRAConfig, LoRARequest, Request, SamplingParams
from tokenbudget.core import Scheduler, SchedulerConfig


def lora(k: int) -> LoRARequest:
    return LoRARequest(f"adapter-{k}", k, f"/adapters/{k}")


def make_scheduler(max_loras: int = 2, num_blocks: int = 400, **sched) -> Scheduler:
    return Scheduler(
        SchedulerConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, **sched}),
        CacheConfig(block_size=4, num_blocks=num_blocks),
        lora_config=LoRAConfig(enable_lora=True, max_loras=max_loras),
    )


def make_request(i: int, adapter: int | None, prompt_len: int = 12, max_tokens: int = 6):
    prompt = [(31 * i + 7 * j) % 500 + 1 for j in range(prompt_len)]
    return Request(
        f"r{i}",
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=float(i),
        lora_request=None if adapter is None else lora(adapter),
    )


def run(scheduler: Scheduler, fake_model, max_steps: int = 2000) -> list[list[str]]:
    """Step to completion, checking the adapter limit every step; the
    requests scheduled in each step."""
    model = fake_model()
    steps = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        scheduled = [scheduler.requests[r] for r in so.num_scheduled_tokens]
        adapters = {r.lora_id for r in scheduled if r.lora_id is not None}
        assert len(adapters) <= scheduler.lora_config.max_loras, adapters
        scheduler.lora_gate.check(scheduled)
        steps.append([r.request_id for r in scheduled])
        scheduler.update_from_output(so, model(scheduler, so))
    assert not scheduler.has_unfinished_requests()
    scheduler.kv_cache_manager.block_pool.check_invariants()
    return steps


def first_steps(steps: list[list[str]]) -> dict[str, int]:
    first: dict[str, int] = {}
    for n, ids in enumerate(steps):
        for rid in ids:
            first.setdefault(rid, n)
    return first


@pytest.mark.parametrize("num_blocks", [400, 24], ids=["roomy", "preempting"])
def test_four_adapters_in_flight_never_more_than_two_per_step(fake_model, num_blocks):
    s = make_scheduler(max_loras=2, num_blocks=num_blocks)
    adapters = [1, 2, 3, 4, None]
    reqs = [make_request(i, adapters[i % 5], prompt_len=10 + i % 7) for i in range(30)]
    for r in reqs:
        s.add_request(r)
    steps = run(s, fake_model)
    first = first_steps(steps)
    assert set(first) == {r.request_id for r in reqs}  # every request ran and finished
    assert all(r.is_finished() for r in reqs)
    if num_blocks == 24:
        assert s.num_preemptions > 0
    # FCFS within an adapter: first scheduled in arrival order.
    for a in adapters:
        mine = [first[r.request_id] for r in reqs if r.lora_id == a]
        assert mine == sorted(mine), a
    # Skipped, not blocking: a base request that arrived after a waiting
    # adapter-3 request ran before it.
    assert first["r4"] < first["r2"]


def test_waiting_request_of_a_third_adapter_keeps_its_place(fake_model):
    s = make_scheduler(max_loras=2, max_num_seqs=2)
    for i, a in enumerate([1, 2, 3, 1]):
        s.add_request(make_request(i, a))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]


def test_running_requests_keep_their_adapters_and_the_gate_counts_them(fake_model):
    s = make_scheduler(max_loras=1, max_num_seqs=4)
    for i, a in enumerate([1, 2, 1, None]):
        s.add_request(make_request(i, a))
    out = s.schedule()
    # r1 (adapter 2) waits while adapter 1 runs; r2 (adapter 1) and base r3 go.
    assert list(out.num_scheduled_tokens) == ["r0", "r2", "r3"]
    s.update_from_output(out, fake_model()(s, out))
    assert run(s, fake_model)[5] == ["r1"]  # once adapter 1 is done


def _cached(s: Scheduler, fake_model, req: Request) -> int:
    s.add_request(req)
    run(s, fake_model)
    return req.num_cached_tokens


def test_prefix_blocks_are_shared_only_within_one_adapter(fake_model):
    s = make_scheduler(max_loras=2)
    prompt = list(range(1, 34))

    def req(i, adapter):
        return Request(
            f"p{i}",
            prompt,
            SamplingParams(max_tokens=2),
            lora_request=None if adapter is None else lora(adapter),
        )

    assert _cached(s, fake_model, req(0, 1)) == 0
    assert _cached(s, fake_model, req(1, 2)) == 0  # same prompt, another adapter
    assert _cached(s, fake_model, req(2, None)) == 0  # the base model
    assert _cached(s, fake_model, req(3, 1)) == 32  # the same adapter: its 8 full blocks
    assert _cached(s, fake_model, req(4, 2)) == 32


def test_adapter_on_an_engine_without_lora_is_refused():
    s = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=64))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        s.add_request(make_request(0, 1))


def test_lora_config_checks_its_values():
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        LoRAConfig(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LoRAConfig(lora_modules=["a=/x"])
    config = LoRAConfig(enable_lora=True, lora_modules=["a=/x", '{"name": "b", "path": "/y"}'])
    assert config.served_adapters() == {
        "a": LoRARequest("a", 1, "/x"),
        "b": LoRARequest("b", 2, "/y"),
    }
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("a", 0, "/x")
