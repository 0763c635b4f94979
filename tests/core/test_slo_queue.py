"""SLOQueue (policy slo's waiting queue, kept in deadline order) against the
full re-sort it replaces: the same operations on a plain FCFS queue
reordered by ``SLOOrder.order_all`` must give the same order, request for
request, at every step."""

from __future__ import annotations

import random

import pytest

from tokenbudget.core import Request, SamplingParams, SchedulerConfig
from tokenbudget.core.policy.queues import FCFSQueue
from tokenbudget.core.request import RequestStatus
from tokenbudget.core.policy.slo import SLOOrder
from tokenbudget.core.policy.slo_queue import SLOQueue


def _reference_arrange(order: SLOOrder, ref: FCFSQueue, now: float, per_step: int) -> list[Request]:
    aged, on_time, late = order.order_all(list(ref), now, per_step)
    if order.reject_late:
        ref.reorder(aged + on_time)
        return late
    ref.reorder(aged + on_time + late)
    return []


@pytest.mark.parametrize("reject_late", [False, True])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("aging_s", [0.0, 1.5])
def test_slo_queue_orders_as_the_full_resort(reject_late, ties, aging_s):
    rng = random.Random(hash((reject_late, ties, aging_s)) & 0xFFFF)
    order = SLOOrder(
        SchedulerConfig(
            policy="slo",
            max_num_batched_tokens=256,
            aging_bound_s=aging_s,
            slo_reject_late=reject_late,
        )
    )
    q, ref = SLOQueue(), FCFSQueue()
    now, n = 0.0, 0
    preempted: list[Request] = []
    for _ in range(250):
        now += rng.choice((0.0, 0.01, 0.05, 0.2))
        for _ in range(rng.randrange(4)):
            arrival = round(now - rng.random() * 0.1, 1 if ties else 9)
            req = Request(
                f"r{n}",
                [1] * rng.randrange(1, 300),
                SamplingParams(max_tokens=8),
                arrival_time=arrival,
                ttft_ms=rng.choice((None, 100.0, 300.0, 1000.0)),
            )
            n += 1
            q.add(req)
            ref.add(req)
        # An in-flight step still adds a token to a request preempted since.
        for req in preempted:
            if rng.random() < 0.5 and req.status == RequestStatus.PREEMPTED:
                req.output_token_ids.append(7)
                req.all_token_ids.append(7)
        preempted = []
        order.step_s = rng.choice((0.0, 0.02, 0.05))
        per_step = rng.choice((1, 64, 256))
        assert q.arrange(order, now, per_step) == _reference_arrange(order, ref, now, per_step)
        assert list(q) == list(ref) and len(q) == len(ref)
        # Admission: pop the head; some are skipped (put back), some admitted.
        popped, skipped = [], []
        for _ in range(rng.randrange(6)):
            if not q:
                break
            req = q.pop()
            assert req is ref.pop()
            (skipped if rng.random() < 0.3 else popped).append(req)
        for req in reversed(skipped):
            q.prepend(req)
            ref.prepend(req)
        for req in popped:
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = len(req.all_token_ids)
            if rng.random() < 0.3:  # preempted later: back at the head, recomputing
                req.output_token_ids.append(5)
                req.all_token_ids.append(5)
                req.status = RequestStatus.PREEMPTED
                req.num_computed_tokens = 0
                q.prepend(req)
                ref.prepend(req)
                preempted.append(req)
        if q and rng.random() < 0.2:  # aborted while waiting
            gone = rng.sample(list(ref), k=min(len(ref), rng.randrange(1, 4)))
            q.remove_requests(gone)
            ref.remove_requests(gone)
        assert [r.request_id for r in q] == [r.request_id for r in ref]
        assert len(q) == len(ref)
