"""Preemption when KV blocks run out: who is the victim, where it goes, and
that it later finishes with exactly the tokens of an unpressured run."""

from __future__ import annotations

import pytest

from tokenbudget.core import RequestStatus


def _oracle_tokens(make_scheduler, make_request, run_to_completion, specs):
    """The same requests with plenty of blocks: no preemption."""
    s = make_scheduler(block_size=4, num_blocks=100)
    for rid, prompt, max_tokens in specs:
        s.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    return run_to_completion(s).tokens


def test_fcfs_victim_goes_to_head_of_waiting_keeps_outputs_and_resumes(
    make_scheduler, make_request, step, run_to_completion
):
    specs = [("a", 4, 6), ("b", 4, 6), ("c", 4, 6), ("d", 4, 6)]
    s = make_scheduler(block_size=4, num_blocks=5, max_num_seqs=3)  # 4 usable blocks
    for rid, prompt, max_tokens in specs:
        s.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    step(s)  # a, b, c prefilled (one block each); d waits for a seat
    c = s.requests["c"]
    c_outputs = list(c.output_token_ids)

    so, _ = step(s)  # a and b each need a second block: only one is free

    assert so.preempted_req_ids == {"c"}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == c_outputs and len(c_outputs) == 1
    assert s.make_stats().num_preemptions == 1

    reqs = [c] + [r for r in s.requests.values() if r is not c]
    run_to_completion(s)
    expected = _oracle_tokens(make_scheduler, make_request, run_to_completion, specs)
    # Every request finishes with the tokens of the unpressured run.
    assert {r.request_id: r.output_token_ids for r in reqs} == expected
    assert len(c.output_token_ids) == 6
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 4


@pytest.mark.parametrize(
    "policy, priorities, victim",
    [
        ("fcfs", {"b": 5, "a": 0, "c": 1}, "c"),  # the last admitted
        ("priority", {"b": 5, "a": 0, "c": 1}, "b"),  # max priority value, though scheduled first
        ("priority", {"b": 1, "a": 0, "c": 1}, "c"),  # equal priority: the later arrival
    ],
)
def test_preemption_victim_by_policy(
    make_scheduler, make_request, step, policy, priorities, victim
):
    s = make_scheduler(block_size=4, num_blocks=4, policy=policy)  # 3 usable blocks
    s.add_request(make_request("b", 2, priority=priorities["b"], max_tokens=10))
    step(s)
    s.add_request(make_request("a", 4, priority=priorities["a"], max_tokens=10))
    s.add_request(make_request("c", 3, priority=priorities["c"], max_tokens=10))
    step(s)
    assert [r.request_id for r in s.running] == ["b", "a", "c"]

    so, _ = step(s)  # only "a" needs a new block, and none is free

    assert so.preempted_req_ids == {victim}
    assert set(so.num_scheduled_tokens) == {"a", "b", "c"} - {victim}
    assert so.total_num_scheduled_tokens == 2
    assert victim not in so.scheduled_cached_reqs.req_ids
    assert s.requests[victim].num_computed_tokens == 0
    s.kv_cache_manager.block_pool.check_invariants()


def test_no_waiting_request_is_admitted_in_a_step_that_preempted(
    make_scheduler, make_request, step
):
    s = make_scheduler(block_size=4, num_blocks=4, max_num_seqs=2, policy="priority")
    s.add_request(make_request("a", 4, priority=0, max_tokens=10))  # 1 block
    s.add_request(make_request("c", 5, priority=1, max_tokens=10))  # 2 blocks
    step(s)
    s.add_request(make_request("d", 2, priority=0, max_tokens=10))  # waits for a seat

    so, _ = step(s)  # "a" needs a block: "c" is preempted, freeing 2; "a" takes 1

    assert so.preempted_req_ids == {"c"}
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    assert so.num_scheduled_tokens == {"a": 1}  # "d" would fit, but must wait a step
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "d": 2}


def test_preempted_requests_finish_with_the_tokens_of_an_unpressured_run(
    make_scheduler, make_request, run_to_completion
):
    specs = [(f"r{i}", 3 + 5 * i, 12) for i in range(6)]
    s = make_scheduler(block_size=4, num_blocks=12, max_num_batched_tokens=16)
    reqs = [make_request(rid, p, max_tokens=m) for rid, p, m in specs]
    for r in reqs:
        s.add_request(r)

    run = run_to_completion(s)

    assert s.make_stats().num_preemptions > 0
    expected = _oracle_tokens(make_scheduler, make_request, run_to_completion, specs)
    assert {r.request_id: r.output_token_ids for r in reqs} == expected
    assert all(len(toks) == 12 for toks in expected.values())
    # Outputs streamed to the caller: each token exactly once despite recomputation.
    assert run.tokens == expected
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 11


def test_resumed_request_is_sent_with_its_full_token_ids_and_block_table(
    make_scheduler, make_request, step
):
    s = make_scheduler(block_size=4, num_blocks=5, max_num_seqs=3)
    for rid in "abc":
        s.add_request(make_request(rid, 4, max_tokens=3))
    step(s)
    step(s)  # "c" preempted
    c = s.requests["c"]
    while "c" not in (so := step(s)[0]).num_scheduled_tokens:
        pass

    cached = so.scheduled_cached_reqs
    assert "c" in cached.resumed_token_ids
    assert cached.resumed_token_ids["c"] == c.prompt_token_ids + c.output_token_ids[:1]
    i = cached.req_ids.index("c")
    assert cached.new_block_ids[i] == s.kv_cache_manager.get_block_ids("c")
    assert cached.num_computed_tokens[i] == 0
    assert so.num_scheduled_tokens["c"] == 5
