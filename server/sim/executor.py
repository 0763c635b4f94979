"""SimulatedExecutor: an Executor with a cost model instead of a model.

Each ``execute_model`` advances a simulated clock by the step's predicted
time and answers like a worker: one sampled token for every request whose
prefill completes in the step, none for a request still mid-prefill. Tokens
are a deterministic function of the request and the output index; a request
given a target output length emits EOS as its last token (unless it ignores
EOS), so the scheduler's own stop rules end it ("stop"), or ``max_tokens``
does ("length"). No torch: only core dataclasses.

Use it with EngineCore's synchronous loop (``async_scheduling=False``):
simulated time runs one step at a time.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.outputs import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenbudget.server.executor.base import Executor
from tokenbudget.server.sim.cost_model import CostModel


class SimClock:
    """Simulated seconds; the scheduler calls it as its ``clock``."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sim_token(seed: int, index: int, eos: int | None, vocab_size: int) -> int:
    """Output token ``index`` of the request with ``seed``: never EOS."""
    token = (seed * 1_000_003 + index * 7919 + 11) % vocab_size
    return token + 1 if token == eos else token


class _ReqState:
    __slots__ = ("num_tokens", "num_outputs", "base", "eos_at")

    def __init__(self, num_tokens: int, seed: int, eos_at: int) -> None:
        self.num_tokens = num_tokens
        self.num_outputs = 0
        # sim_token(seed, k, ...) is (base + k * 7919) % vocab_size, EOS bumped.
        self.base = seed * 1_000_003 + 11
        # Outputs from this index on are EOS (the target length).
        self.eos_at = eos_at


class SimulatedExecutor(Executor):
    def __init__(
        self,
        cost_model: CostModel,
        clock: SimClock,
        *,
        vocab_size: int,
        eos_token_id: int | None = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.gpu_memory_utilization = gpu_memory_utilization
        # request id -> (token seed, target output length or None); set before
        # the request is added. Unknown ids get seed 0 and no target.
        self.plans: dict[str, tuple[int, int | None]] = {}
        self._reqs: dict[str, _ReqState] = {}
        self.num_steps = 0
        self.busy_s = 0.0

    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        # A host tier only as asked for in blocks (no host memory is modelled).
        host = cache_config.num_offload_blocks or 0
        if cache_config.num_blocks is not None:
            return KVCacheSpec(cache_config.num_blocks, host)
        model = self.cost_model.model
        free = (
            self.cost_model.hardware.memory_bytes * self.gpu_memory_utilization
            - model.num_params * model.dtype_bytes
        )
        blocks = int(free // (model.kv_bytes_per_token * cache_config.block_size))
        if blocks < 2:
            raise ValueError(f"{model.name} does not fit on {self.cost_model.hardware.name}")
        return KVCacheSpec(blocks, host)

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        # The hot loop of a simulation: one pass over the scheduled requests,
        # sums the cost model needs kept inline.
        reqs = self._reqs
        for rid in so.finished_req_ids:
            reqs.pop(rid, None)
        num_scheduled = so.num_scheduled_tokens
        eos = self.eos_token_id
        vocab = self.vocab_size
        cached = so.scheduled_cached_reqs
        starts = dict(zip(cached.req_ids, cached.num_computed_tokens))
        for nrd in so.scheduled_new_reqs:
            seed, target = self.plans.pop(nrd.req_id, (0, None))
            no_eos = target is None or eos is None or nrd.sampling_params.ignore_eos
            reqs[nrd.req_id] = _ReqState(
                len(nrd.prompt_token_ids), seed, sys.maxsize if no_eos else target
            )
            starts[nrd.req_id] = nrd.num_computed_tokens
        for rid, resumed in cached.resumed_token_ids.items():
            reqs[rid].num_tokens = len(resumed)
        req_ids = list(num_scheduled)
        sampled: list[list[int]] = []
        append = sampled.append
        tokens = sum(num_scheduled.values())
        context = sum(starts.values()) + tokens
        pairs = prefills = 0
        for rid, n in num_scheduled.items():
            c = starts[rid]
            if n == 1:
                pairs += c + 1
            else:
                prefills += 1
                pairs += n * c + n * (n + 1) // 2
            state = reqs[rid]
            if c + n < state.num_tokens:
                append([])  # mid-prefill
                continue
            k = state.num_outputs = state.num_outputs + 1
            state.num_tokens += 1
            if k >= state.eos_at:
                append([eos])
            else:
                token = (state.base + k * 7919) % vocab  # sim_token, inlined
                append([token + 1 if token == eos else token])
        if req_ids:  # a step that only tells the worker what finished costs nothing
            dt = self.cost_model.time_of(
                self.cost_model.terms_from_sums(tokens, len(req_ids), pairs, context, prefills)
            )
            self.clock.now += dt
            self.busy_s += dt
            self.num_steps += 1
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(
            ModelRunnerOutput(req_ids, dict(zip(req_ids, range(len(req_ids)))), sampled)
        )
        return future

    def shutdown(self) -> None:
        self._reqs.clear()
