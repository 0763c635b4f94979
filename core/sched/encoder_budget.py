"""Encoder (vision) inputs per chunk: which items a request's chunk must
encode this step, within the step's encoder budget and the encoder cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.request import Request
    from tokenbudget.core.sched.encoder_cache import EncoderCacheManager
    from tokenbudget.core.sched.step import Step


class EncoderBudget:
    def __init__(self, cache: EncoderCacheManager) -> None:
        self.cache = cache

    def plan(self, req: Request, start: int, num_new: int, step: Step) -> tuple[list[int], int]:
        """Encoder inputs to run for tokens [start, start + num_new), and the
        possibly shortened token count.

        An item is encoded in the step whose token range first overlaps its
        placeholder. If the budget or the cache cannot take it, the chunk stops
        just before the placeholder."""
        end = start + num_new
        ecm = self.cache
        to_schedule: list[int] = []
        num_embeds = 0
        for i, f in enumerate(req.mm_features):
            if f.offset >= end:
                break
            if f.offset + f.length <= start:
                continue  # its tokens are already computed
            if ecm.check_and_update_cache(req, i):
                continue
            if any(req.mm_features[j].mm_hash == f.mm_hash for j in to_schedule):
                continue  # the same image twice in this chunk: one encoder run serves both
            if not ecm.can_allocate(req, i, step.encoder_budget - num_embeds, num_embeds):
                num_new = f.offset - start
                break
            to_schedule.append(i)
            num_embeds += f.length
        return to_schedule, num_new

    def commit(self, req: Request, input_ids: list[int], step: Step) -> None:
        """Take the cache entries and the budget of the planned ``input_ids``."""
        ecm = self.cache
        for i in input_ids:
            ecm.allocate(req, i)
            step.encoder_budget -= req.mm_features[i].length
        step.encoder_inputs[req.request_id] = input_ids

    def free_computed(self, req: Request) -> None:
        """Free the encoder outputs ``req`` no longer needs.

        A placeholder fully computed no longer needs the encoder output; the
        entry stays cached (freeable) for other requests with that image. An
        image repeated later in the prompt keeps its entry until then."""
        computed = req.num_computed_tokens
        pending = {f.mm_hash for f in req.mm_features if f.offset + f.length > computed}
        for i, f in enumerate(req.mm_features):
            if f.offset + f.length > computed:
                break
            if f.mm_hash not in pending:
                self.cache.free_encoder_input(req, i)
