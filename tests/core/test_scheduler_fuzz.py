"""Scheduler fuzzing that can find a wedge (issue 10).

A hypothesis state machine drives the real EngineCore (sync or async
scheduling, grammar bitmasks filled at schedule time or deferred) over a
fake worker that, like a real one, knows only what SchedulerOutputs tell it.
Rules add requests (priorities, shared prefixes, structured output with real
xgrammar matchers over a 12-token vocabulary, a grammar that fails to
compile now and then), abort them, step the engine, and restart the worker
with another KV size (EngineCore.reinitialize: after it, max_model_len may
exceed the cache, so some requests can never fit). Pools are small, drafts
and prefix caching on or off, policies fcfs / priority (with preemption by
priority) / lpm.

Checked at every step: the block pool's invariants (no leak, ref counts,
the free queue with hash-less blocks first, then cached ones), the token
budget, max_num_seqs, only running requests scheduled, the worker never
scheduled past the tokens it knows, a reply without a required token is
never needed (the scheduler raises on one), every structured token inside
its grammar, and no wedge (requests left, and several steps with nothing
sent and nothing returned). At the end, with no more arrivals, every
request finishes within a bound of steps, exactly once, with the tokens it
streamed; "error" only for a request that can never fit in the whole cache
alone or whose grammar failed; every block is free.

The default run is short (about 5 s); TOKENBUDGET_FUZZ_EXAMPLES (machines,
default 40) and TOKENBUDGET_FUZZ_STEPS (rules per machine, default 40) make
it longer, and ``-s`` prints what it ran (operations: adds, aborts, restarts
and engine steps, the final drains included).
"""

from __future__ import annotations

import itertools
import os
import random
from collections import deque

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tokenbudget.core import (
    CacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.core.kv.groups import request_capacity_tokens
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.core.structured.manager import StructuredOutputManager

EXAMPLES = int(os.environ.get("TOKENBUDGET_FUZZ_EXAMPLES", "60"))
STEPS = int(os.environ.get("TOKENBUDGET_FUZZ_STEPS", "50"))
VOCAB = ["<eos>", "a", "b", "c", "ab", "{", "}", '"', ":", ",", "1", " "]
EOS = 0
GRAMMARS = [
    {"regex": "(ab|c)+1"},
    {"choice": ["abc", "ba", "c"]},
    {"json_object": True},
    {"regex": "(a|b)*"},
]
BROKEN_GRAMMAR = {"regex": "(ab"}  # parses nowhere: its request fails alone
# Consecutive engine steps with requests left, nothing sent to the worker and
# nothing returned that make a wedge.
WEDGE_STEPS = 3
TOTALS = {
    "machines": 0,
    "operations": 0,
    "requests": 0,
    "preemptions": 0,
    "restarts": 0,
    "structured": 0,
    "masked_steps": 0,
    "deferred_masks": 0,
    "finished": {},
    "modes": {},
}


class TinyVocabOutputs(StructuredOutputManager):
    """The real manager, its compiler built over VOCAB (no tokenizer needed)."""

    def _get_compiler(self):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS])
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


class _Reply:
    """The Future of one step's reply, computed when first asked for (after
    the engine filled a deferred bitmask), steps always in sent order."""

    def __init__(self, worker: FuzzWorker, so: SchedulerOutput) -> None:
        self.worker, self.so, self.value = worker, so, None

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        while self.value is None:
            self.worker.run_next()
        return self.value

    def cancel(self) -> bool:
        if self in self.worker.queue:
            self.worker.queue.remove(self)
        return True


class FuzzWorker:
    """An executor that keeps each request's tokens itself and samples random
    tokens (inside the grammar bitmask, accepting a random prefix of the
    drafts) for the requests whose known tokens a step completes."""

    def __init__(
        self, machine: SchedulerMachine, num_blocks: int, spec: int, defer_masks: bool
    ) -> None:
        self.m, self.spec = machine, spec
        # KV cache groups (GroupsMachine): one drawn pool per group.
        self.windows: tuple[int, ...] = getattr(machine, "windows", ())
        self.num_blocks = num_blocks
        self.defers_grammar_bitmask = defer_masks
        self.rng = machine.rng
        self.tokens: dict[str, list[int]] = {}
        self.queue: deque[_Reply] = deque()
        self.num_sent = 0  # steps with work
        # Block tables as the deltas build them (interleaved over KV cache groups).
        self.tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @num_blocks.setter
    def num_blocks(self, drawn: int) -> None:
        self._num_blocks = 1 + max(len(self.windows), 1) * (drawn - 1)

    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        return KVCacheSpec(self.num_blocks, 0, self.windows)

    def reinitialize(self) -> KVCacheSpec:
        self.tokens.clear()
        self.queue.clear()
        self.tables.clear()
        return KVCacheSpec(self.num_blocks, 0, self.windows)

    def shutdown(self) -> None:
        self.queue.clear()

    def execute_model(self, so: SchedulerOutput) -> _Reply:
        s, cfg = self.m.engine.scheduler, self.m.sched_cfg
        counts = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(counts.values()) <= cfg.max_num_batched_tokens
        assert all(n > 0 for n in counts.values())
        assert len(s.running) <= cfg.max_num_seqs
        assert set(counts) <= {r.request_id for r in s.running}
        s.kv_cache_manager.block_pool.check_invariants()
        self._check_tables(so, s.kv_cache_manager)
        self.num_sent += not so.is_empty
        reply = _Reply(self, so)
        self.queue.append(reply)
        return reply

    def _check_tables(self, so: SchedulerOutput, kv) -> None:
        """The tables the deltas build equal the scheduler's, except where a
        sliding-window group gave a block back (the null block 0 there)."""
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
        cached = so.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in cached.resumed_token_ids:
                self.tables[rid] = list(ids)
            else:
                self.tables[rid].extend(ids)
        groups = max(len(self.windows), 1)
        for rid in so.num_scheduled_tokens:
            want, got = kv.get_block_ids(rid), self.tables[rid]
            assert len(want) == len(got) and len(got) % groups == 0, (rid, want, got)
            assert all(w in (0, g) for w, g in zip(want, got)), (rid, want, got)
            real = [b for b in want if b]
            assert len(set(real)) == len(real), f"{rid}: a block in two places {want}"

    def run_next(self) -> None:
        reply = self.queue.popleft()
        reply.value = self._run(reply.so)

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            if rid in cached.resumed_token_ids:
                self.tokens[rid] = list(cached.resumed_token_ids[rid])
            computed[rid] = n
        mask = so.grammar_bitmask
        if mask is not None and not isinstance(mask, np.ndarray):
            mask = mask.result(timeout=10)  # deferred: the engine filled it by now
            TOTALS["deferred_masks"] += 1
        TOTALS["masked_steps"] += mask is not None
        first_row, k = {}, 0
        for rid in so.structured_req_ids:
            first_row[rid] = k
            k += 1 + len(so.scheduled_spec_decode_tokens.get(rid, ()))
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        drafts: list[list[int]] = []
        for rid in ids:
            history = self.tokens[rid]
            scheduled = so.scheduled_spec_decode_tokens.get(rid, [])
            end = computed[rid] + so.num_scheduled_tokens[rid]
            known = len(history) + len(scheduled)
            assert end <= known, f"{rid}: scheduled past the tokens the worker knows"
            new: list[int] = []
            if end == known:
                rows = None if rid not in first_row else mask[first_row[rid] :]
                new = self._sample(scheduled, rows)
                history.extend(new)
            sampled.append(new)
            drafts.append(
                [self.rng.randrange(1, len(VOCAB)) for _ in range(self.rng.randint(0, self.spec))]
                if new
                else []
            )
        return ModelRunnerOutput(
            ids,
            {r: i for i, r in enumerate(ids)},
            sampled,
            spec_token_ids=drafts if self.spec else None,
        )

    def _sample(self, drafts: list[int], rows: np.ndarray | None) -> list[int]:
        """Verify the drafts (each kept at random where its row allows it), then
        one token the row allows that is not the draft there."""
        out: list[int] = []
        for t in range(len(drafts) + 1):
            allowed = (
                list(range(len(VOCAB)))
                if rows is None
                else [v for v in range(len(VOCAB)) if rows[t, v // 32] >> (v % 32) & 1]
            )
            if t < len(drafts) and drafts[t] in allowed and self.rng.random() < 0.6:
                out.append(drafts[t])
                continue
            others = [v for v in allowed if t >= len(drafts) or v != drafts[t]]
            out.append(self.rng.choice(others) if others else EOS)
            return out
        raise AssertionError("unreachable")


@st.composite
def configs(draw) -> tuple[SchedulerConfig, CacheConfig, bool, bool]:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    spec = draw(st.sampled_from([0, 0, 1, 3]))
    async_scheduling = draw(st.booleans())
    sched = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(2, 64)),
        max_num_seqs=draw(st.integers(1, 5)),
        max_model_len=draw(st.integers(8, 96)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])),
        policy=draw(st.sampled_from(["fcfs", "priority", "lpm"])),
        priority_preemption_threshold=draw(st.sampled_from([-1, 0, 1])),
        speculative_config={"method": "ngram", "num_speculative_tokens": spec} if spec else None,
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(
        block_size=block_size,
        num_blocks=1 + draw(pool_blocks(block_size, spec)),
        enable_prefix_caching=draw(st.booleans()),
    )
    return sched, cache, draw(st.booleans()), async_scheduling and draw(st.booleans())


def pool_blocks(block_size: int, spec: int):
    """From a pool that holds one small request to one that holds several."""
    return st.integers(-(-(8 + spec) // block_size), 96 // block_size)


class SchedulerMachine(RuleBasedStateMachine):
    """One engine and its fake worker; rules add, abort, step and restart."""

    @initialize(
        config=configs(),
        seed=st.integers(0, 2**16),
        tick_s=st.sampled_from([0.001, 0.5, 5.0]),
        came_back_smaller=st.booleans(),
    )
    def setup(self, config, seed: int, tick_s: float, came_back_smaller: bool) -> None:
        self.sched_cfg, self.cache_cfg, structured, defer_masks = config
        self.rng = random.Random(seed)
        self.spec = self.sched_cfg.num_speculative_tokens
        self.som = (
            TinyVocabOutputs(None, len(VOCAB), compile_threads=1, fill_threads=1)
            if structured
            else None
        )
        num_blocks = self.cache_cfg.num_blocks
        if came_back_smaller:
            # The engine starts with a cache that holds max_model_len, and its
            # worker comes back with the drawn one: max_model_len stays, so
            # some requests can never fit.
            need = self.sched_cfg.max_model_len + self.spec
            self.cache_cfg.num_blocks = 1 + -(-need // self.cache_cfg.block_size)
        self.worker = FuzzWorker(self, self.cache_cfg.num_blocks, self.spec, defer_masks)
        # A pool smaller than max_model_len lowers it here (fit_max_model_len).
        self.engine = EngineCore(self.sched_cfg, self.cache_cfg, self.worker, self.som)
        if came_back_smaller:
            self.worker.num_blocks = num_blocks
            self.engine.discard_requests()
            self.engine.reinitialize()
        self.tick_s = tick_s
        self._set_clock()
        self.requests: dict[str, Request] = {}
        self.streamed: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.broken: set[str] = set()  # requests whose grammar cannot compile
        self.errors: dict[str, str] = {}
        self.idle = 0
        TOTALS["machines"] += 1
        mode = (
            ("async, deferred masks" if defer_masks else "async")
            if self.sched_cfg.async_scheduling
            else "sync"
        )
        mode += f", {self.spec} drafts" if self.spec else ""
        mode += ", structured" if structured else ""
        TOTALS["modes"][mode] = TOTALS["modes"].get(mode, 0) + 1

    def _set_clock(self) -> None:
        # Policies read the clock (lpm ages waiting requests): a clock that
        # ticks per call keeps a run independent of the machine's speed.
        ticks = itertools.count()
        self.engine.scheduler.clock = lambda: next(ticks) * self.tick_s

    @property
    def pool_tokens(self) -> int:
        return (self.engine.cache_config.num_blocks - 1) * self.cache_cfg.block_size

    # -- rules ----------------------------------------------------------------------
    @rule(
        batch=st.lists(
            st.tuples(
                st.integers(1, 70),
                st.booleans(),
                st.integers(1, 40),
                st.integers(0, 2),
                st.booleans(),
                st.sampled_from([None, None] + GRAMMARS + [BROKEN_GRAMMAR]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def add(self, batch: list[tuple]) -> None:
        """Requests (prompt length, shared prefix, max_tokens, priority,
        ignore_eos, grammar) arriving together."""
        for spec in batch:
            self._add(*spec)

    def _add(
        self,
        prompt_len: int,
        shared: bool,
        max_tokens: int,
        priority: int,
        ignore_eos: bool,
        grammar: dict | None,
    ) -> None:
        TOTALS["operations"] += 1
        rid = f"r{len(self.requests)}"
        base = (
            [1, 2, 3, 4, 5, 6, 7, 8] * 9
            if shared
            else [self.rng.randrange(1, len(VOCAB)) for _ in range(prompt_len)]
        )
        structured = grammar if self.som is not None else None
        req = Request(
            rid,
            base[:prompt_len],
            SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, structured=structured),
            eos_token_id=EOS,
            priority=priority,
            arrival_time=float(len(self.requests)),
        )
        self.requests[rid] = req
        if structured == BROKEN_GRAMMAR:
            self.broken.add(rid)
        too_long = (
            prompt_len > self.engine.scheduler_config.max_model_len
            or prompt_len + self.spec > self.pool_tokens
        )
        try:
            self.engine.add_request(req)
        except ValueError:
            assert too_long, f"{req} refused though it fits"
            del self.requests[rid]
            self.broken.discard(rid)
            return
        assert not too_long, f"{req} accepted though it can never run"
        TOTALS["requests"] += 1
        if structured is not None:
            TOTALS["structured"] += 1
            # Compiles run on a thread: wait for them so a run does not depend
            # on the machine's speed (each call returns when one finished).
            for _ in range(len(GRAMMARS) + 1):
                self.som.wait_for_compiles(10.0)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data(), really=st.integers(0, 3))
    def abort(self, data, really: int) -> None:
        if really:  # a rarer operation than add and step: most requests should run
            return
        TOTALS["operations"] += 1
        rid = data.draw(st.sampled_from(sorted(self.requests)), label="abort")
        live = rid in self.engine.scheduler.requests
        assert (self.engine.abort_requests([rid]) == [rid]) == live
        if live:
            self.finish[rid] = "abort (by the test)"
        self.engine.scheduler.kv_cache_manager.block_pool.check_invariants()

    @rule(n=st.integers(1, 6))
    def step(self, n: int) -> None:
        for _ in range(n):
            self._step()

    @rule(data=st.data(), really=st.integers(0, 23))
    def restart(self, data, really: int) -> None:
        """The worker went away and came back, maybe with another KV size:
        every request is dropped (aborted) and the engine serves again."""
        if really:  # rarer still
            return
        TOTALS["operations"] += 1
        TOTALS["restarts"] += 1
        self.worker.num_blocks = 1 + data.draw(
            pool_blocks(self.cache_cfg.block_size, self.spec), label="blocks"
        )
        old = self.engine.scheduler
        for rid in list(old.requests):
            self.finish[rid] = "abort (by the test)"
        TOTALS["preemptions"] += old.num_preemptions
        self.engine.discard_requests()
        self.engine.reinitialize()
        self._set_clock()
        pool = self.engine.scheduler.kv_cache_manager.block_pool
        pool.check_invariants()
        assert (
            pool.get_num_free_blocks()
            == self.engine.cache_config.num_blocks - 1
            == self.worker.num_blocks - 1
        )

    # -- one engine step --------------------------------------------------------------
    def _step(self) -> None:
        TOTALS["operations"] += 1
        sent = self.worker.num_sent
        outputs = self.engine.step()
        for out in outputs:
            self.streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                assert out.request_id not in self.finish, f"{out.request_id} finished twice"
                self.finish[out.request_id] = out.finish_reason
                if out.error is not None:
                    self.errors[out.request_id] = str(out.error)
                req = self.requests[out.request_id]
                if out.finish_reason == "error" and "grammar bitmask" in str(out.error):
                    # The fake worker samples EOS where a grammar allows no token
                    # of the tiny vocabulary: the grammar refuses it, the request fails.
                    assert req.sampling_params.structured is not None, out
                elif out.finish_reason == "error":
                    # Only a request that can never fit alone: past the whole cache.
                    assert req.num_tokens + self.spec > self.pool_tokens, req
                    assert (
                        req.num_prompt_tokens + req.max_tokens - 1 + self.spec > self.pool_tokens
                    ), req
        s = self.engine.scheduler
        s.kv_cache_manager.block_pool.check_invariants()
        compiling = self.som is not None and self.som.has_pending()
        stuck = (
            self.engine.has_unfinished_requests()
            and not outputs
            and self.worker.num_sent == sent
            and not compiling
        )
        self.idle = self.idle + 1 if stuck else 0
        assert self.idle < WEDGE_STEPS, f"wedged: {list(s.requests.values())}"

    # -- the end: no more arrivals ---------------------------------------------------------
    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine, s = self.engine, self.engine.scheduler
        live = [self.requests[r] for r in s.requests]
        # Generous, but finite: every live request's whole length, recomputed
        # a few times over (preemptions), a step per token at worst.
        bound = 10 + 4 * sum(r.num_prompt_tokens + r.max_tokens for r in live)
        for _ in range(bound):
            if not engine.has_unfinished_requests():
                break
            self._step()
        assert not engine.has_unfinished_requests(), (
            f"not finished within {bound} steps: {list(s.requests.values())}"
        )
        pool = s.kv_cache_manager.block_pool
        pool.check_invariants()
        assert pool.get_num_free_blocks() == self.engine.cache_config.num_blocks - 1
        assert not s.running and not s.waiting and not s.kv_cache_manager.req_to_blocks
        for rid, req in self.requests.items():
            reason = self.finish.get(rid)
            assert reason is not None, f"{req} never finished"
            if rid in self.broken and reason != "abort (by the test)":
                # A grammar that cannot compile aborts its request alone, saying why.
                assert reason == "abort" and "structured.regex" in self.errors[rid], reason
                reason = "abort (grammar failed)"
            TOTALS["finished"][reason] = TOTALS["finished"].get(reason, 0) + 1
            assert reason != "abort", f"{req} aborted, not by the test"
            if not reason.startswith("abort"):
                assert self.streamed.get(rid, []) == req.output_token_ids
        TOTALS["preemptions"] += s.num_preemptions
        engine.shutdown()


SchedulerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestSchedulerFuzz = SchedulerMachine.TestCase


def teardown_module() -> None:
    print(f"\nscheduler fuzz: {TOTALS}")


class GroupsMachine(SchedulerMachine):
    """The same machine over a model with KV cache groups (core/kv/groups.py):
    full + sliding window, or a sliding window alone, grammars on or off.
    (SchedulerMachine's own source is left alone: Hypothesis seeds its
    examples from it.)"""

    @initialize(
        config=configs(),
        windows=st.sampled_from([(0, 5), (0, 13), (6,)]),
        seed=st.integers(0, 2**16),
        tick_s=st.sampled_from([0.001, 0.5, 5.0]),
        came_back_smaller=st.booleans(),
    )
    def setup(self, config, windows, seed: int, tick_s: float, came_back_smaller: bool) -> None:
        self.windows = windows
        super().setup(config, seed, tick_s, came_back_smaller)

    @property
    def pool_tokens(self) -> int:
        cfg = self.engine.cache_config
        return request_capacity_tokens(cfg.num_blocks, cfg.block_size, self.windows)


GroupsMachine.TestCase.settings = settings(
    SchedulerMachine.TestCase.settings, max_examples=max(EXAMPLES // 3, 1)
)
TestSchedulerFuzzGroups = GroupsMachine.TestCase
