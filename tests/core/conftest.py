"""Small builders for scheduler tests, handed out as fixtures (test modules
cannot import each other under --import-mode=importlib).

The fake model is a stand-in for a worker: after ``schedule()`` it samples one
token for every request whose prefill is complete (plus accepted drafts with
speculative decoding). Tokens are a deterministic function of the request's
token history, so a run with preemptions can be compared with one without.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import pytest

from tokenbudget.core import (
    CacheConfig,
    ModelRunnerOutput,
    MultiModalFeature,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

VOCAB = 1000
EOS = 999  # never produced by history_token, so only scripted tokens stop on EOS

_SCHED_FIELDS = {f.name for f in fields(SchedulerConfig)}
_CACHE_FIELDS = {f.name for f in fields(CacheConfig)}


def history_token(token_ids: list[int], vocab: int = VOCAB - 1) -> int:
    """The next token as a function of all tokens so far (a stable hash)."""
    digest = hashlib.blake2b(repr(token_ids).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def _make_request(
    request_id: str,
    prompt: list[int] | int = 8,
    *,
    max_tokens: int = 16,
    eos: int | None = EOS,
    priority: int = 0,
    arrival: float | None = None,
    mm: list[tuple[str, int, int]] | None = None,
    salt: str | None = None,
    **sampling,
) -> Request:
    """``prompt`` is a token list or a length (tokens derived from the id, so
    two requests with different ids share nothing). ``mm`` items are
    ``(mm_hash, offset, length)``."""
    if isinstance(prompt, int):
        base = int(hashlib.blake2b(request_id.encode(), digest_size=4).hexdigest(), 16)
        prompt = [(base + 7 * i) % (VOCAB - 1) for i in range(prompt)]
    features = [MultiModalFeature(h, off, n) for h, off, n in (mm or [])]
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_id=eos,
        priority=priority,
        arrival_time=arrival if arrival is not None else float(_arrivals.next()),
        mm_features=features,
        cache_salt=salt,
    )


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n


_arrivals = _Counter()


def _make_scheduler(**kwargs) -> Scheduler:
    """Keyword arguments go to SchedulerConfig or CacheConfig by name."""
    unknown = set(kwargs) - _SCHED_FIELDS - _CACHE_FIELDS
    assert not unknown, f"unknown config fields {unknown}"
    kwargs.setdefault("num_blocks", 1000)
    sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in _SCHED_FIELDS})
    cache = CacheConfig(**{k: v for k, v in kwargs.items() if k in _CACHE_FIELDS})
    return Scheduler(sched, cache)


@dataclass
class FakeModel:
    """Samples for every scheduled request whose prefill is complete.

    ``script`` maps a request id to the tokens it must emit, in order (then
    history tokens). ``accept`` maps a request id to how many of its scheduled
    drafts to accept (default: all). ``drafts`` proposes draft tokens for the
    next step from the request (default: none).
    """

    script: dict[str, list[int]] = field(default_factory=dict)
    accept: dict[str, int] = field(default_factory=dict)
    drafts: Callable[[Request], list[int]] | None = None
    num_steps: int = 0

    def __call__(self, scheduler: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        proposals: list[list[int]] = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            new: list[int] = []
            # num_computed_tokens already counts this step's tokens.
            if req.num_computed_tokens >= req.num_tokens:
                scheduled_drafts = so.scheduled_spec_decode_tokens.get(rid, [])
                n_accept = min(self.accept.get(rid, len(scheduled_drafts)), len(scheduled_drafts))
                new = list(scheduled_drafts[:n_accept])
                new.append(self._next_token(rid, req.all_token_ids + new))
            sampled.append(new)
            proposals.append(self.drafts(req) if (self.drafts and new) else [])
        return ModelRunnerOutput(
            req_ids,
            {r: i for i, r in enumerate(req_ids)},
            sampled,
            spec_token_ids=proposals if self.drafts else None,
        )

    def _next_token(self, rid: str, history: list[int]) -> int:
        script = self.script.get(rid)
        if script:
            return script.pop(0)
        return history_token(history)


def _step(
    scheduler: Scheduler, model: FakeModel | None = None
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    so = scheduler.schedule()
    if so.is_empty:  # as EngineCore: outputs made outside a model step still come out
        return so, scheduler.take_side_outputs()
    model = model or FakeModel()
    return so, scheduler.update_from_output(so, model(scheduler, so))


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    schedules: list[dict[str, int]] = field(default_factory=list)
    outputs: list[SchedulerOutput] = field(default_factory=list)


def _run_to_completion(
    scheduler: Scheduler,
    model: FakeModel | None = None,
    max_steps: int = 10_000,
    check: Callable[[Scheduler], None] | None = None,
) -> Run:
    """Step until no request is left; record each request's tokens, finish
    reason and every step's num_scheduled_tokens."""
    model = model or FakeModel()
    run = Run()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so, outs = _step(scheduler, model)
        run.outputs.append(so)
        run.schedules.append(dict(so.num_scheduled_tokens))
        if check is not None:
            check(scheduler)
        for o in outs:
            run.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                run.finish_reasons[o.request_id] = o.finish_reason
    else:
        raise AssertionError(
            f"requests still unfinished after {max_steps} steps: "
            f"{list(scheduler.requests.values())}"
        )
    scheduler.kv_cache_manager.block_pool.check_invariants()
    return run


def kv_id(tokens: list[int], position: int) -> int:
    """The identity of the KV at ``position``: the token history up to it."""
    return hash(tuple(tokens[: position + 1]))


class KVOracle:
    """Stands in for the worker's KV cache: each device block and host slot
    holds, per offset, the ``kv_id`` written there. It runs the copies a
    SchedulerOutput lists (swap-outs, then swap-ins, as the worker does) and
    then the step: every position a request reads (before its scheduled ones)
    must hold exactly its own KV, and the scheduled positions (drafts
    included) are written. A wrong copy, a hit on a block whose KV was never
    computed, or a block or slot reused while still needed is a wrong read.
    Import it (``from .conftest import KVOracle``): hypothesis tests cannot
    take function-scoped fixtures."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tables: dict[str, list[int]] = {}
        self.num_reads = 0

    def _block(self, store: dict, key: int) -> list:
        return store.setdefault(key, [None] * self.bs)

    def copy_and_track(self, so: SchedulerOutput) -> dict[str, int]:
        """Run the step's copies and update each request's block table; the
        first computed position of each scheduled request."""
        # Each slot / block is written at most once per step (the worker copies
        # in one batch: a repeated target would be a race).
        assert len({slot for _, slot in so.kv_swap_out}) == len(so.kv_swap_out)
        assert len({block for _, block in so.kv_swap_in}) == len(so.kv_swap_in)
        for block, slot in so.kv_swap_out:
            self.host[slot] = list(self._block(self.device, block))
        for slot, block in so.kv_swap_in:
            self.device[block] = list(self.host[slot])
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tables.pop(rid, None)
        starts = {}
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
            starts[new.req_id] = new.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, ids, start in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            if rid in c.resumed_token_ids:
                self.tables[rid] = list(ids)
            else:
                self.tables[rid].extend(ids)
            starts[rid] = start
        return starts

    def step(self, s: Scheduler, so: SchedulerOutput) -> None:
        starts = self.copy_and_track(so)
        bs = self.bs
        for rid, n in so.num_scheduled_tokens.items():
            tokens = s.requests[rid].all_token_ids + so.scheduled_spec_decode_tokens.get(rid, [])
            table = self.tables[rid]
            for p in range(starts[rid]):
                got = self._block(self.device, table[p // bs])[p % bs]
                assert got == kv_id(tokens, p), (
                    f"{rid} reads wrong KV at position {p} (block {table[p // bs]})"
                )
                self.num_reads += 1
            for p in range(starts[rid], starts[rid] + n):
                self._block(self.device, table[p // bs])[p % bs] = kv_id(tokens, p)


@pytest.fixture
def make_request():
    return _make_request


@pytest.fixture
def make_scheduler():
    return _make_scheduler


@pytest.fixture
def step():
    return _step


@pytest.fixture
def run_to_completion():
    return _run_to_completion


@pytest.fixture
def fake_model():
    return FakeModel


@pytest.fixture(name="history_token")
def history_token_fixture():
    return history_token
