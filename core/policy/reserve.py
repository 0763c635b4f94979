"""SGLang's ``new_token_ratio``: admit a request only if the running
requests' expected future tokens still fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenbudget.core.config import SchedulerConfig
from tokenbudget.core.policy.base import SchedulingPolicy, blocks_to_admit

if TYPE_CHECKING:
    from tokenbudget.core.kv import KVCacheBlock, KVCacheManager
    from tokenbudget.core.policy.base import Admission, StepView
    from tokenbudget.core.request import Request


class AdmissionReserve(SchedulingPolicy):
    """Reserve KV for running requests' expected future tokens when admitting.

    expected = sum over running of min(max_tokens - generated, clip) * ratio
    (ratio 1 for ignore_eos requests, which always run to max_tokens). The
    ratio starts optimistic, decays every step toward its floor while
    nothing is preempted, and is re-estimated from observed progress after a
    preemption, like TCP congestion control."""

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.ratio = config.init_new_token_ratio
        self.min_ratio = config.min_new_token_ratio
        self.decay = config.new_token_ratio_decay
        self.clip = config.reserve_clip_tokens
        self.block_size = block_size
        # This admission round: the blocks reserved so far, and what it reads
        # (``running`` is the scheduler's list, which admission appends to).
        self._reserved = 0.0
        self._running: list[Request] = []
        self._kv: KVCacheManager | None = None

    def on_step(self) -> None:
        self.ratio = max(self.ratio - self.decay, self.min_ratio)

    def on_preemption(self, running: list[Request]) -> None:
        # Observed progress plus a margin of a few decode steps per request.
        decoded = sum(r.num_output_tokens for r in running)
        wanted = sum(r.max_tokens for r in running)
        if wanted:
            estimate = (decoded + 20 * len(running)) / wanted
            self.ratio = min(1.0, max(estimate, self.ratio, self.min_ratio))

    def future_tokens(self, req: Request) -> float:
        left = min(req.max_tokens - req.num_output_tokens, self.clip)
        return left * (1.0 if req.sampling_params.ignore_eos else self.ratio)

    def reserve_blocks(self, running: list[Request], windows: tuple[int, ...] = (0,)) -> float:
        """Blocks the running requests' expected future tokens take in every
        KV cache group (``windows``, core/kv/groups.py)."""
        clip = self.clip
        eos = full = 0
        for r in running:
            left = min(r.max_tokens - len(r.output_token_ids), clip)
            if r.sampling_params.ignore_eos:
                full += left
            else:
                eos += left
        tokens = (eos * self.ratio + full) * windows.count(0)
        for w in windows:
            if w:  # a sliding (chunked) group holds a window (chunk) of each request's tokens
                tokens += sum(min(self.future_tokens(r), abs(w)) for r in running)
        return tokens / self.block_size

    def growth_blocks(self, req: Request) -> float:
        """Blocks ``req``'s expected future tokens take in every KV cache group."""
        t = self.future_tokens(req)
        return sum(t if w == 0 else min(t, abs(w)) for w in self._kv.windows) / self.block_size

    # -- SchedulingPolicy ----------------------------------------------------------
    def begin_step(self, step: StepView, running: list[Request], waiting) -> None:
        self.on_step()

    def order_waiting(
        self, step: StepView, waiting, running: list[Request], kv: KVCacheManager
    ) -> Admission | None:
        # Not an order: the start of an admission round.
        self._reserved = self.reserve_blocks(running, kv.windows)
        self._running = running
        self._kv = kv
        return None

    def admits(self, req: Request, num_new: int, hits: list[KVCacheBlock], num_cached: int) -> bool:
        """Whether the running requests' expected growth, and this request's
        own, still fit after its blocks are taken."""
        if not self._running:
            return True  # an idle engine admits whatever fits now, or nothing would run
        kv = self._kv
        need = blocks_to_admit(kv, hits, num_cached, num_new)
        return kv.num_free_blocks() - need >= self._reserved + self.growth_blocks(req)

    def on_admitted(self, req: Request) -> None:
        self._reserved += self.growth_blocks(req)

    def on_scheduled(self, step: StepView, running: list[Request], requests) -> None:
        if step.preempted:  # memory ran short this step
            self.on_preemption(running)
