"""Preemption: who gives way, and the one displacement path.

A running request is preempted in two cases:

- memory is short: the scheduler cannot allocate a running request's chunk
  and preempts the policy's victim (``pick_victim``) until it can; the step
  then admits nothing;
- displacement: a waiting request may take the seat and blocks of running
  requests the policy offers (``displacement_candidates``: worse priority,
  or tenants above their fair share), but only as many as it needs and only
  if that suffices; admission goes ahead.

A preempted request goes back to the head of the waiting queue and
recomputes later, or, with room in the host KV tier, has its KV swapped out
and back in (core/kv/tiering.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenbudget.core.policy.base import blocks_to_admit, chunk_size, implements
from tokenbudget.core.request import RequestStatus

if TYPE_CHECKING:
    from tokenbudget.core.config import SchedulerConfig
    from tokenbudget.core.kv import KVCacheManager
    from tokenbudget.core.kv.tiering import KVTiering
    from tokenbudget.core.policy.base import SchedulingPolicy
    from tokenbudget.core.request import Request
    from tokenbudget.core.sched.encoder_cache import EncoderCacheManager
    from tokenbudget.core.sched.step import Step


class Preemptor:
    def __init__(
        self,
        policy: SchedulingPolicy,
        config: SchedulerConfig,
        kv: KVCacheManager,
        tiering: KVTiering,
        encoder_cache: EncoderCacheManager,
        waiting,
    ) -> None:
        self.policy = policy
        self.kv = kv
        self.tiering = tiering
        self.encoder_cache = encoder_cache
        self.waiting = waiting
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.threshold = config.long_prefill_token_threshold
        self._displaces = implements(policy, "displacement_candidates")

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when memory is short."""
        return self.policy.pick_victim(running)

    def preempt(self, req: Request, step: Step, running: list[Request]) -> int:
        """Preempt ``req`` because memory is short. Returns the index it had
        in ``running``."""
        return self._preempt(req, step, running, step.preempted)

    def _preempt(
        self, req: Request, step: Step, running: list[Request], into: list[Request]
    ) -> int:
        index = running.index(req)
        del running[index]
        step.unschedule(req)  # a victim may have been scheduled earlier this step
        self.tiering.on_preempt(req)  # swap its KV out, while it is known
        self.kv.free(req)
        if req.mm_features:
            self.encoder_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.waiting.prepend(req)
        into.append(req)
        return index

    def displace_for(self, running: list[Request], step: Step) -> None:
        """Let the head of the waiting queue displace the running requests the
        policy offers (none is scheduled yet this step) when it lacks a seat
        or its first chunk's blocks: only as many as it needs, and only if
        that suffices."""
        if not self._displaces or not self.waiting:
            return
        head = self.waiting.peek()
        if head.status != RequestStatus.WAITING:
            return
        need_blocks, free, need_seat = self._head_needs(head, running)
        if free >= need_blocks and not need_seat:
            return
        victims: list[Request] = []
        for r in self.policy.displacement_candidates(head, running):
            if free >= need_blocks and not (need_seat and not victims):
                break
            victims.append(r)
            # Only blocks no one else references come back.
            free += self.kv.num_reclaimable_blocks(r.request_id)
        if free < need_blocks or (need_seat and not victims):
            return
        for r in victims:
            self._preempt(r, step, running, step.displaced)

    def _head_needs(self, head: Request, running: list[Request]) -> tuple[int, int, bool]:
        """What admitting ``head``'s first chunk takes: (blocks it needs,
        blocks free now, whether every seat is taken)."""
        kv = self.kv
        hits, num_cached = kv.get_computed_blocks(head)
        chunk = chunk_size(head.num_tokens - num_cached, self.budget, self.threshold)
        # Every KV cache group's blocks, as the allocation will take them.
        need_blocks = blocks_to_admit(kv, hits, num_cached, chunk)
        return need_blocks, kv.num_free_blocks(), len(running) >= self.max_num_seqs
