"""make_policy composes the parts a config turns on behind one
SchedulingPolicy (core/policy/factory.py): which parts, and how a hook that
several parts implement combines them."""

from __future__ import annotations

from tokenbudget.core import Request, SamplingParams, SchedulerConfig
from tokenbudget.core.policy.base import Admission, SchedulingPolicy
from tokenbudget.core.policy.factory import PolicySet, make_policy


def _config(**kw) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512, **kw)


def _req(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))


def test_fcfs_turns_on_only_the_victim_order():
    policy = make_policy(_config(policy="fcfs"), block_size=16)
    assert list(policy.parts) == ["victims"]
    # A hook no part implements stays the protocol's no-op.
    assert policy.admits(_req("a"), 3, 0, 0) is True
    running = [_req("a"), _req("b")]
    assert policy.order_running(running, 0.0) is running


def test_each_option_adds_its_part_in_hook_order():
    policy = make_policy(_config(policy="lpm", fair_share=True), block_size=16)
    assert list(policy.parts) == ["order", "fair_share", "reserve", "victims"]
    policy = make_policy(_config(policy="slo", admission_reserve=False), block_size=16)
    assert list(policy.parts) == ["slo", "victims"]
    policy = make_policy(_config(policy="priority"), block_size=16)
    assert list(policy.parts) == ["priority", "victims"]
    policy = make_policy(
        _config(policy="priority", priority_preemption_threshold=-1), block_size=16
    )
    assert list(policy.parts) == ["victims"]


def test_a_hook_one_part_implements_is_that_parts_method():
    policy = make_policy(_config(policy="priority"), block_size=16)
    priority = policy.parts["priority"]
    assert policy.displacement_candidates == priority.displacement_candidates


def test_fair_share_picks_memory_victims_before_the_plain_victim_order():
    policy = make_policy(_config(policy="fcfs", fair_share=True), block_size=16)
    assert policy.pick_victim == policy.parts["fair_share"].pick_victim


class _Admits(SchedulingPolicy):
    def __init__(self, answer: bool, log: list[str], name: str) -> None:
        self.answer, self.log, self.name = answer, log, name

    def admits(self, req, num_new, hits, num_cached) -> bool:
        self.log.append(self.name)
        return self.answer

    def order_waiting(self, step, waiting, running, kv) -> Admission | None:
        return Admission({self.name}, [_req(f"late-{self.name}")])

    def order_running(self, running, now):
        return [*running, _req(f"after-{self.name}")]


def test_hooks_several_parts_implement_run_in_order_and_combine():
    log: list[str] = []
    policy = PolicySet({"a": _Admits(True, log, "a"), "b": _Admits(False, log, "b")})
    assert policy.admits(_req("x"), 3, 0, 0) is False  # every part must admit
    assert log == ["a", "b"]
    admission = policy.order_waiting(None, [], [], None)
    assert admission.deprioritized == {"a", "b"}
    assert [r.request_id for r in admission.late] == ["late-a", "late-b"]
    # Each part orders what the one before it returned.
    assert [r.request_id for r in policy.order_running([], 0.0)] == ["after-a", "after-b"]
