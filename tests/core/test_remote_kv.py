"""The scheduler with a KV connector (disaggregated prefill/decode), against
a fake connector: decode-side requests wait for their prompt's KV holding
blocks but no budget or seat, resume as new requests that already have the
prefill's first token, and prefill-side blocks stay held until their send is
done. The invariants: the token budget and max_num_seqs are never exceeded,
and once every request ended and the connector let go, every block is free.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tokenbudget.core import CacheConfig, ModelRunnerOutput, SchedulerConfig, SchedulerOutput
from tokenbudget.core.failures import DuplicateRequestError
from tokenbudget.core.kv.connector import (
    DECODE,
    PREFILL,
    ConnectorEvents,
    KVConnector,
    KVConnectorMetadata,
    KVSend,
    KVTransferParams,
)
from tokenbudget.core.outputs import KVCacheSpec
from tokenbudget.core.request import RequestStatus
from tokenbudget.core.sched.scheduler import Scheduler
from tokenbudget.server.engine.core import EngineCore

EOS = 999
NUM_BLOCKS = 200


class FakeConnector(KVConnector):
    """Decode role for requests whose kv_transfer_params say decode: their
    KV arrives when the test calls ``deliver`` (or, with ``auto``, after
    ``delay`` events polls, with the token ``auto`` picks). Prefill role:
    a finished request's blocks are held until a worker reports its send."""

    def __init__(self, auto=None, delay: int = 3) -> None:
        self.auto = auto
        self.delay = delay
        self.allocated: dict[str, tuple[list[int], int]] = {}
        self.countdown: dict[str, int] = {}
        self.received: set[str] = set()
        self.events = ConnectorEvents()
        self.to_send: dict[str, list[int]] = {}
        self.sending: set[str] = set()
        self.held: set[str] = set()  # request_finished said True, not yet freeable
        self.sends: list[KVSend] = []
        self.aborted_finished: list[str] = []
        self.shut = False

    # -- test controls
    def deliver(self, rid: str, token: int) -> None:
        self.received.add(rid)
        self.events.received[rid] = token

    def fail(self, rid: str, reason: str) -> None:
        self.received.add(rid)
        self.events.failed[rid] = reason

    def release(self, rid: str) -> None:
        self.held.discard(rid)
        self.events.freeable.append(rid)

    # -- KVConnector
    def num_remote_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params
        if p is None or p.role != DECODE:
            return 0
        return request.num_tokens - num_computed_tokens

    def on_allocated(self, request, block_ids, num_local_tokens):
        assert request.request_id not in self.allocated
        self.allocated[request.request_id] = (list(block_ids), num_local_tokens)
        if self.auto is not None:
            self.countdown[request.request_id] = self.delay

    def request_finished(self, request, block_ids):
        rid = request.request_id
        p = request.kv_transfer_params
        held = False
        if p is not None and p.role == PREFILL:
            self.to_send[rid] = list(block_ids)
            held = True
        elif rid in self.allocated and rid not in self.received:
            held = True  # aborted while the peer may still write into its blocks
        if held:
            self.held.add(rid)
        return held

    def build_metadata(self):
        if not self.has_pending():
            return None
        sends = [KVSend(rid, ids, ids, [b"peer"]) for rid, ids in self.to_send.items()]
        self.sends += sends
        self.sending |= set(self.to_send)
        self.to_send.clear()
        return KVConnectorMetadata(sends=sends)

    def on_worker_output(self, finished_sending, failed_sending):
        for rid in set(finished_sending) | set(failed_sending):
            self.sending.discard(rid)
            self.release(rid)

    def take_events(self):
        if self.auto is not None:
            for rid in list(self.countdown):
                self.countdown[rid] -= 1
                if self.countdown[rid] <= 0:
                    del self.countdown[rid]
                    if rid in self.held:  # aborted meanwhile: the "peer" stops now
                        self.release(rid)
                    else:
                        self.deliver(rid, self.auto(rid))
        events, self.events = self.events, ConnectorEvents()
        return events

    def has_pending(self):
        return bool(self.to_send or self.sending or self.held or self.countdown)

    def abort_finished(self, request_id):
        self.aborted_finished.append(request_id)

    def shutdown(self):
        self.shut = True


def _scheduler(connector, **kw) -> Scheduler:
    sched = {k: kw.pop(k) for k in list(kw) if k in SchedulerConfig.__dataclass_fields__}
    cache = CacheConfig(block_size=4, num_blocks=NUM_BLOCKS, **kw)
    return Scheduler(SchedulerConfig(**sched), cache, kv_connector=connector)


def _remote(make_request, rid, prompt=10, role=DECODE, **kw):
    req = make_request(rid, prompt, eos=EOS, **kw)
    req.kv_transfer_params = KVTransferParams(role, room=hash(rid) & 0xFFFF)
    return req


def _step(s: Scheduler, model):
    """As EngineCore: an empty step carrying connector metadata still goes to
    the worker (a poll step), and its reply through update_from_output."""
    so = s.schedule()
    if so.is_empty and so.kv_connector_metadata is None:
        return so, s.take_side_outputs()
    mro = model(s, so) if not so.is_empty else ModelRunnerOutput.empty()
    if so.kv_connector_metadata is not None:
        mro.finished_sending = {send.request_id for send in so.kv_connector_metadata.sends}
    return so, s.update_from_output(so, mro)


def _all_free(s: Scheduler) -> bool:
    s.kv_cache_manager.block_pool.check_invariants()
    return s.kv_cache_manager.num_free_blocks() == NUM_BLOCKS - 1


def test_requests_waiting_for_remote_kv_take_no_budget_and_no_seat(make_request, fake_model):
    conn = FakeConnector()
    s = _scheduler(conn, max_num_seqs=2, max_num_batched_tokens=32)
    # Each remote prompt alone is more than the step's whole budget.
    for i in range(5):
        s.add_request(_remote(make_request, f"d{i}", prompt=40, max_tokens=3))
    for i in range(4):
        s.add_request(make_request(f"l{i}", 20, max_tokens=4, eos=EOS))
    model = fake_model()
    tokens: dict[str, list[int]] = {}
    for n in range(200):
        if not s.has_unfinished_requests():
            break
        if n == 3:
            for i in range(5):
                conn.deliver(f"d{i}", 500 + i)
        so, outs = _step(s, model)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= 32
        assert len(s.running) <= 2
        assert len(so.num_scheduled_tokens) <= 2
        if n == 0:
            # Admitted in the same step as the local requests, which got the
            # whole budget and both seats.
            assert set(s.waiting_for_kv) == {f"d{i}" for i in range(5)}
            assert so.total_num_scheduled_tokens == 32
            assert {r.request_id for r in s.running} == {"l0", "l1"}
            assert all(len(conn.allocated[f"d{i}"][0]) == 10 for i in range(5))
        if n < 3:
            assert not any(rid.startswith("d") for rid in so.num_scheduled_tokens)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not s.has_unfinished_requests()
    assert {rid: len(t) for rid, t in tokens.items()} == {
        **{f"d{i}": 3 for i in range(5)},
        **{f"l{i}": 4 for i in range(4)},
    }
    assert all(tokens[f"d{i}"][0] == 500 + i for i in range(5))
    assert not s.has_pending_transfers()
    assert _all_free(s)


def test_a_request_resumes_the_step_after_its_kv_arrives(make_request, fake_model):
    conn = FakeConnector()
    s = _scheduler(conn)
    model = fake_model()
    s.add_request(_remote(make_request, "d", prompt=10, max_tokens=4))
    so, outs = _step(s, model)
    assert so.is_empty and outs == []
    req = s.requests["d"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    block_ids, num_local = conn.allocated["d"]
    assert num_local == 0 and len(block_ids) == 3 == len(s.kv_cache_manager.get_block_ids("d"))
    # Nothing is a prefix hit before its KV is written.
    twin = make_request("twin", list(req.prompt_token_ids), eos=EOS)
    assert s.kv_cache_manager.get_computed_blocks(twin)[1] == 0
    so, outs = _step(s, model)  # still waiting
    assert so.is_empty and outs == []

    conn.deliver("d", 77)
    so, outs = _step(s, model)
    (new,) = so.scheduled_new_reqs
    assert (new.req_id, new.output_token_ids, new.num_computed_tokens) == ("d", [77], 10)
    assert new.block_ids == block_ids
    assert so.num_scheduled_tokens == {"d": 1}
    # The received token comes out first, then the one this step sampled.
    assert [o.request_id for o in outs] == ["d", "d"]
    assert outs[0].new_token_ids == [77] and not outs[0].finished
    assert len(outs[1].new_token_ids) == 1 and model.num_steps == 1
    # Its full prompt blocks are now prefix hits.
    assert s.kv_cache_manager.get_computed_blocks(twin)[1] == 8
    tokens = [t for o in outs for t in o.new_token_ids]
    while s.has_unfinished_requests():
        tokens += [t for o in _step(s, model)[1] for t in o.new_token_ids]
    assert len(tokens) == 4 and tokens[0] == 77
    assert s.kv_cache_manager.prefix_queries == 10  # looked up once
    assert _all_free(s)


@pytest.mark.parametrize(
    "token, max_tokens, reason", [(EOS, 8, "stop"), (5, 1, "length"), (6, 8, None)]
)
def test_a_received_token_that_ends_the_request_needs_no_model_step(
    make_request, fake_model, token, max_tokens, reason
):
    conn = FakeConnector()
    s = _scheduler(conn)
    model = fake_model()
    req = _remote(make_request, "d", prompt=9, max_tokens=max_tokens, stop_token_ids=[6])
    s_prompt = req.prompt_token_ids
    s.add_request(req)
    _step(s, model)
    conn.deliver("d", token)
    so, outs = _step(s, model)
    (out,) = outs
    assert out.new_token_ids == [token]
    if reason is None:  # a stop token id: stop reason is the token
        assert (out.finish_reason, out.stop_reason) == ("stop", 6)
    else:
        assert out.finish_reason == reason
    assert so.is_empty and model.num_steps == 0
    assert not s.has_unfinished_requests()
    assert _all_free(s)
    # Its prompt's KV (received) stays findable for later requests.
    twin = make_request("twin", list(s_prompt), eos=EOS)
    assert s.kv_cache_manager.get_computed_blocks(twin)[1] == 8


def test_a_failed_transfer_ends_the_request_with_its_reason(make_request, fake_model):
    conn = FakeConnector()
    s = _scheduler(conn)
    s.add_request(_remote(make_request, "d", prompt=12))
    s.add_request(make_request("l", 6, max_tokens=2, eos=EOS))
    model = fake_model()
    _step(s, model)
    conn.fail("d", "prefill unreachable")
    _, outs = _step(s, model)
    (err,) = [o for o in outs if o.request_id == "d"]
    assert err.finish_reason == "error" and err.new_token_ids == []
    assert "prefill unreachable" in str(err.error) and "prefill unreachable" in err.stop_reason
    assert "d" not in s.requests and "d" not in s.waiting_for_kv
    while s.has_unfinished_requests():
        _step(s, model)
    assert _all_free(s)


def test_an_abort_while_waiting_holds_the_blocks_until_freeable(make_request, fake_model):
    conn = FakeConnector()
    s = _scheduler(conn)
    s.add_request(_remote(make_request, "d", prompt=12))
    model = fake_model()
    _step(s, model)
    assert s.finish_requests("d", RequestStatus.FINISHED_ABORTED) == ["d"]
    assert not s.has_unfinished_requests() and s.has_pending_transfers()
    assert s.kv_cache_manager.num_free_blocks() == NUM_BLOCKS - 1 - 3  # still held
    with pytest.raises(DuplicateRequestError):
        s.add_request(_remote(make_request, "d", prompt=12))
    conn.deliver("d", 3)  # a late arrival for an aborted request changes nothing
    _step(s, model)
    assert s.kv_cache_manager.num_free_blocks() == NUM_BLOCKS - 1 - 3
    conn.release("d")
    _step(s, model)
    assert not s.has_pending_transfers()
    assert _all_free(s)
    s.add_request(_remote(make_request, "d", prompt=12))  # the id is free again


def test_prefill_side_blocks_stay_held_until_the_send_finished(make_request, fake_model):
    conn = FakeConnector()
    s = _scheduler(conn)
    model = fake_model()
    s.add_request(_remote(make_request, "p", prompt=10, role=PREFILL, max_tokens=1))
    so, outs = _step(s, model)
    assert so.num_scheduled_tokens == {"p": 10}
    (out,) = outs
    assert out.finished and len(out.new_token_ids) == 1
    # Finished, but its blocks stay for the send.
    assert not s.has_unfinished_requests() and s.has_pending_transfers()
    held_ids = conn.to_send["p"]
    assert len(held_ids) == 3
    assert s.kv_cache_manager.num_free_blocks() == NUM_BLOCKS - 1 - 3
    # The poll step carries the send; the worker's report frees the blocks.
    so, outs = _step(s, model)
    assert so.is_empty and outs == []
    assert [(x.request_id, x.src_block_ids) for x in so.kv_connector_metadata.sends] == [
        ("p", held_ids)
    ]
    assert s.kv_cache_manager.num_free_blocks() == NUM_BLOCKS - 1 - 3
    _step(s, model)  # the connector lists it freeable, the scheduler frees
    assert not s.has_pending_transfers()
    assert _all_free(s)


def test_an_abort_of_a_finished_request_held_for_its_send_reaches_the_connector(
    make_request, fake_model
):
    conn = FakeConnector()
    s = _scheduler(conn)
    model = fake_model()
    s.add_request(_remote(make_request, "p", prompt=10, role=PREFILL, max_tokens=1))
    s.add_request(make_request("other", list(range(1, 6)), max_tokens=4))
    _step(s, model)
    assert "p" in s.held_for_kv
    # The gateway aborts both halves (its client left): a finished request
    # that still holds blocks is the connector's to stop; others are not.
    assert s.finish_requests(["p", "other", "unknown"], RequestStatus.FINISHED_ABORTED) == ["other"]
    assert conn.aborted_finished == ["p"]
    s.finish_requests(["p"], RequestStatus.FINISHED_STOPPED)  # not an abort: nothing to stop
    assert conn.aborted_finished == ["p"]


# -- the engine loops ---------------------------------------------------------------
VOCAB = 50


def _token(history: list[int]) -> int:
    return (sum(history) * 31 + len(history)) % VOCAB + 100


class FakeExecutor:
    """Keeps each request's tokens (prompt, then output_token_ids a new
    request already has) and samples ``_token`` of the history; reports the
    sends a step lists as finished."""

    def __init__(self, threaded: bool) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.pool = ThreadPoolExecutor(1) if threaded else None
        self.num_poll_steps = 0
        self.spec = KVCacheSpec(NUM_BLOCKS, kv_transfer_handshakes=(b"rank0",))

    def initialize(self, cache_config, scheduler_config):
        return self.spec

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self.pool is not None:
            return self.pool.submit(self._run, so)
        fut: Future[ModelRunnerOutput] = Future()
        fut.set_result(self._run(so))
        return fut

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_poll_steps += so.is_empty
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
        computed = {}
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + new.output_token_ids
            computed[new.req_id] = new.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, n in zip(c.req_ids, c.num_computed_tokens):
            if rid in c.resumed_token_ids:
                self.tokens[rid] = list(c.resumed_token_ids[rid])
            computed[rid] = n
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            history = self.tokens[rid]
            end = computed[rid] + so.num_scheduled_tokens[rid]
            assert end <= len(history)
            if end == len(history):
                history.append(_token(history))
                sampled.append([history[-1]])
            else:
                sampled.append([])
        mro = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
        meta = so.kv_connector_metadata
        if meta is not None and meta.sends:
            mro.finished_sending = {x.request_id for x in meta.sends}
        return mro

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


SPECS = [(f"r{i}", 5 + 9 * i % 23, 2 + 5 * i % 9) for i in range(12)]


def _run_engine(make_request, *, async_scheduling: bool, threaded: bool, disagg: bool):
    executor = FakeExecutor(threaded)
    prompts = {}
    specs_seen = []

    def factory(spec):
        specs_seen.append(spec)
        # The prefill's first token: what this engine would sample itself.
        return FakeConnector(auto=lambda rid: _token(list(prompts[rid])), delay=2)

    engine = EngineCore(
        SchedulerConfig(
            max_num_seqs=3, max_num_batched_tokens=16, async_scheduling=async_scheduling
        ),
        CacheConfig(block_size=4),
        executor,
        kv_connector_factory=factory if disagg else None,
    )
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for i, (rid, prompt, max_tokens) in enumerate(SPECS):
        req = make_request(rid, prompt, max_tokens=max_tokens, eos=EOS)
        prompts[rid] = req.prompt_token_ids
        if disagg and i % 3 != 2:  # decode and prefill roles, and some plain requests
            role = DECODE if i % 3 == 0 else PREFILL
            req.kv_transfer_params = KVTransferParams(role, room=i)
        engine.add_request(req)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError("the engine did not finish")
    conn = engine.scheduler.kv_connector
    engine.shutdown()
    assert engine.num_free_blocks() == NUM_BLOCKS - 1
    engine.scheduler.kv_cache_manager.block_pool.check_invariants()
    if disagg:
        assert specs_seen == [executor.spec] and conn.shut
        assert not conn.has_pending() and executor.num_poll_steps > 0
        assert {x.request_id for x in conn.sends} == {r for r, *_ in SPECS[1::3]}
    return tokens, reasons


@pytest.mark.parametrize(
    "async_scheduling, threaded", [(False, False), (True, False), (True, True)]
)
def test_engine_loops_finish_everything_and_free_every_block(
    make_request, async_scheduling, threaded
):
    local = _run_engine(make_request, async_scheduling=False, threaded=False, disagg=False)
    disagg = _run_engine(
        make_request, async_scheduling=async_scheduling, threaded=threaded, disagg=True
    )
    # The oracle: the prefill's first token is what this engine would have
    # sampled, so every request's tokens equal the plain run's.
    assert disagg == local
    assert len(local[1]) == len(SPECS)


# -- a received token and the request's grammar -------------------------------------
GRAMMAR_VOCAB = ["<eos>", "a", "b", "c", "ab", "1"]


@pytest.fixture
def tiny_grammars():
    pytest.importorskip("xgrammar")
    from tokenbudget.core.structured.manager import StructuredOutputManager

    class TinyVocab(StructuredOutputManager):
        def _get_compiler(self):
            import xgrammar as xgr

            if self._compiler is None:
                info = xgr.TokenizerInfo(
                    GRAMMAR_VOCAB, vocab_size=len(GRAMMAR_VOCAB), stop_token_ids=[0]
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    som = TinyVocab(None, len(GRAMMAR_VOCAB), compile_threads=1, fill_threads=1)
    yield som
    som.shutdown()


@pytest.mark.parametrize("token, allowed", [(1, True), (5, False)])
def test_a_received_token_goes_through_the_grammar(make_request, tiny_grammars, token, allowed):
    conn = FakeConnector()
    s = Scheduler(
        SchedulerConfig(),
        CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
        tiny_grammars,
        kv_connector=conn,
    )
    req = _remote(make_request, "d", prompt=6, structured={"choice": ["abc", "ba", "c"]})
    req.eos_token_id = 0
    s.add_request(req)
    for _ in range(50):
        tiny_grammars.wait_for_compiles(1.0)
        _step(s, None)
        if "d" in s.waiting_for_kv:
            break
    conn.deliver("d", token)
    # The worker samples "b" (what the mask allows after "a").
    so, outs = _step(s, lambda s, so: ModelRunnerOutput(["d"], {"d": 0}, [[2]]))
    if allowed:
        assert [o.new_token_ids for o in outs] == [[token], [2]]
        assert so.num_scheduled_tokens == {"d": 1}
        # The matcher took "a" then "b": "a" again is outside ("abc", "ba",
        # "c"); had it missed the received "a", "ba" would allow it.
        assert not req.structured_request.matcher.accept_token(1)
        s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    else:  # not output; the request alone fails
        (out,) = outs
        assert out.new_token_ids == [] and out.finish_reason == "error"
        assert so.is_empty
    assert not s.has_unfinished_requests()
    assert _all_free(s)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_polls_pending_transfers_every_few_ms_and_keeps_its_connector(
    make_request, async_scheduling
):
    conn = FakeConnector()
    executor = FakeExecutor(threaded=False)
    engine = EngineCore(
        SchedulerConfig(async_scheduling=async_scheduling),
        CacheConfig(block_size=4),
        executor,
        kv_connector_factory=lambda spec: conn,
    )
    engine.add_request(_remote(make_request, "d", prompt=9))  # its KV never comes
    engine.step()
    assert engine.scheduler.waiting_for_kv and engine.has_unfinished_requests()
    engine.abort_requests(["d"])  # held: the "peer" may still write
    assert engine.has_unfinished_requests()  # pending transfers keep the loop going
    start, polls = time.monotonic(), executor.num_poll_steps
    for _ in range(5):
        assert engine.step() == []
    # Each step went to the workers (their reply may report sends) and slept.
    assert executor.num_poll_steps - polls == 5
    assert time.monotonic() - start >= 5 * 0.002
    conn.release("d")
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == NUM_BLOCKS - 1
    engine.discard_requests()
    assert engine.scheduler.kv_connector is conn
    engine.shutdown()
    assert conn.shut


def test_workers_that_come_back_get_a_connector_built_from_their_new_handshakes():
    """A reconnect re-registers the workers' KV (new agents, new handshakes):
    the old connector is shut down and a new one built from the new spec,
    or peers would be handed stale addresses."""
    executor = FakeExecutor(threaded=False)
    built: list[tuple[FakeConnector, KVCacheSpec]] = []

    def factory(spec):
        built.append((FakeConnector(), spec))
        return built[-1][0]

    executor.reinitialize = lambda: KVCacheSpec(NUM_BLOCKS, kv_transfer_handshakes=(b"new",))
    engine = EngineCore(
        SchedulerConfig(), CacheConfig(block_size=4), executor, kv_connector_factory=factory
    )
    engine.discard_requests()
    engine.reinitialize()
    (old, _), (new, spec) = built
    assert old.shut and not new.shut
    assert spec.kv_transfer_handshakes == (b"new",)
    assert engine.scheduler.kv_connector is new
    engine.shutdown()
