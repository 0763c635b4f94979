"""One step's ledger: what schedule() has handed out so far, and the
SchedulerOutput built from it (with the grammar bitmask of its
structured-output requests).

The chunk rule (how many tokens a request gets) is ``chunk_size`` in
core/policy/base.py, shared with the policies that predict chunks.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenbudget.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenbudget.core.policy.base import chunk_size

if TYPE_CHECKING:
    from tokenbudget.core.config import SchedulerConfig
    from tokenbudget.core.kv import KVCacheManager
    from tokenbudget.core.request import Request

__all__ = ["Step", "chunk_size", "grammar_bitmask", "fill_grammar_bitmask"]


@dataclass(slots=True)
class Step:
    """What one schedule() call has handed out so far."""

    token_budget: int
    encoder_budget: int
    now: float = 0.0
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    resumed: set[str] = field(default_factory=set)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Preempted because memory ran short (admission is skipped then).
    preempted: list[Request] = field(default_factory=list)
    # Preempted for a waiting request (priority, fair share): admission still runs.
    displaced: list[Request] = field(default_factory=list)
    # Prompt tokens each tenant may still get this step (set by fair share), or None.
    tenant_caps: dict[str | None, int] | None = None

    @classmethod
    def begin(cls, config: SchedulerConfig, now: float) -> Step:
        return cls(config.max_num_batched_tokens, config.encoder_compute_budget, now)

    def unschedule(self, req: Request) -> None:
        """Give back what ``req`` got this step (it is being preempted)."""
        rid = req.request_id
        if rid not in self.num_scheduled:
            return
        self.token_budget += self.num_scheduled.pop(rid)
        self.cached_reqs.remove(req)
        self.new_block_ids.pop(rid, None)
        self.spec_tokens.pop(rid, None)
        for input_id in self.encoder_inputs.pop(rid, ()):
            self.encoder_budget += req.mm_features[input_id].length

    def build_output(
        self,
        kv: KVCacheManager,
        total_budget: int,
        *,
        finished: set[str],
        num_common_prefix_blocks: int,
        free_encoder_mm_hashes: list[str],
        grammar: tuple,
    ) -> SchedulerOutput:
        """The step as sent to the workers (``grammar``: its bitmask and the
        ids of the requests it covers)."""
        new_reqs = [
            NewRequestData(
                r.request_id,
                r.prompt_token_ids,
                r.mm_features,
                r.sampling_params,
                kv.get_block_ids(r.request_id),
                r.num_computed_tokens,
                r.lora_id,
                None if r.sampling_params.ignore_eos else r.eos_token_id,
                r.pooling_params,
                r.lora_request,
                list(r.output_token_ids),
            )
            for r in self.new_reqs
        ]
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=self._cached_data(kv),
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=total_budget - self.token_budget,
            scheduled_spec_decode_tokens=self.spec_tokens,
            scheduled_encoder_inputs=self.encoder_inputs,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=finished,
            preempted_req_ids={r.request_id for r in self.preempted + self.displaced},
            free_encoder_mm_hashes=free_encoder_mm_hashes,
            grammar_bitmask=grammar[0],
            structured_req_ids=grammar[1],
        )

    def _cached_data(self, kv: KVCacheManager) -> CachedRequestData:
        scheduled = self.cached_reqs
        req_ids = [r.request_id for r in scheduled]
        cached = CachedRequestData(req_ids, [], [r.num_computed_tokens for r in scheduled])
        if self.resumed:
            for r in scheduled:
                rid = r.request_id
                if rid in self.resumed:
                    # Resumed: its whole block table and tokens, the worker dropped them.
                    cached.new_block_ids.append(kv.get_block_ids(rid))
                    cached.resumed_token_ids[rid] = list(r.all_token_ids)
                else:
                    cached.new_block_ids.append(self.new_block_ids[rid])
        else:
            new_block_ids = self.new_block_ids
            cached.new_block_ids = [new_block_ids[rid] for rid in req_ids]
        return cached


def grammar_bitmask(step: Step, som, requests: dict[str, Request], defer: bool) -> tuple:
    """The step's grammar bitmask and the ids of the requests it covers. With
    ``defer``, a Future that fill_grammar_bitmask resolves once the previous
    step's tokens are accepted."""
    if som is None:
        return None, []
    if defer:
        structured_ids = som.sampling_req_ids(step.num_scheduled, step.spec_tokens)
        return (Future() if structured_ids else None), structured_ids
    return som.grammar_bitmask(requests, step.num_scheduled, step.spec_tokens)


def fill_grammar_bitmask(som, scheduler_output: SchedulerOutput) -> None:
    """Resolve a deferred grammar_bitmask from the matchers' current state:
    call once the tokens of every earlier step are accepted. No-op for a
    mask that is already an array, resolved or cancelled."""
    mask = scheduler_output.grammar_bitmask
    if not isinstance(mask, Future) or mask.done():
        return
    try:
        mask.set_result(
            som.fill_bitmask(
                scheduler_output.structured_req_ids, scheduler_output.scheduled_spec_decode_tokens
            )
        )
    except BaseException as exc:  # the worker waiting on it must not hang
        mask.set_exception(exc)
        raise
