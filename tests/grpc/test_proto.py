"""The protobuf layer: generated code is fresh, and conversion round-trips exactly."""

from __future__ import annotations

import filecmp
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from tokenbudget.core import (
    CacheConfig,
    CachedRequestData,
    ModelRunnerOutput,
    MultiModalFeature,
    NewRequestData,
    PromptLogprobs,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.core.lora import LoRARequest
from tokenbudget.core.pooling_params import PoolingParams
from tokenbudget.proto import common_pb2, convert, step_stream, worker_pb2
from tokenbudget.proto.generate import PROTO_DIR


def test_committed_generated_code_matches_the_proto_sources(tmp_path):
    # protoc runs in a child process: grpc_tools' protoc and NIXL (loaded by
    # the disaggregation tests) crash when they share one process.
    subprocess.run(
        [sys.executable, "-m", "tokenbudget.proto.generate", "--out", str(tmp_path)], check=True
    )
    written = sorted(p for p in tmp_path.iterdir() if p.suffix in (".py", ".pyi"))
    assert written
    for fresh in written:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), (
            f"{fresh.name} is not committed; run python -m tokenbudget.proto.generate"
        )
        assert filecmp.cmp(fresh, committed, shallow=False), (
            f"{fresh.name} is stale; run python -m tokenbudget.proto.generate"
        )


def _scheduler_output() -> SchedulerOutput:
    image = {
        "pixel_values": torch.randn(16, 12),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "deepstack": [torch.randn(2, 3).to(torch.bfloat16)],
        "note": "x",
        "scale": 0.5,
    }
    new = [
        NewRequestData(
            "a",
            [1, 2, 3, 4, 5],
            [MultiModalFeature("h0", 1, 3, image)],
            SamplingParams(
                max_tokens=7,
                temperature=0.0,
                top_k=5,
                seed=3,
                stop_token_ids=[9, 8],
                logprobs=2,
                structured={"choice": ["yes", "no"]},
            ),
            [1, 2],
            0,
        ),
        NewRequestData(
            "b",
            [7] * 40,
            [],
            SamplingParams(structured={"json_schema": '{"type": "object"}'}),
            [3, 4, 5],
            16,
            lora_id=2,
            eos_token_id=11,
            pooling_params=PoolingParams("MEAN", False),
            lora_request=LoRARequest("sql", 2, "/adapters/sql"),
        ),
    ]
    cached = CachedRequestData(
        req_ids=["c", "d", "e"],
        new_block_ids=[[], [6], [7, 8, 9]],
        num_computed_tokens=[33, 17, 0],
        resumed_token_ids={"e": [5, 6, 7, 8]},
    )
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"c": 1, "a": 5, "d": 3, "b": 24, "e": 4},
        total_num_scheduled_tokens=37,
        scheduled_spec_decode_tokens={"d": [4, 5]},
        scheduled_encoder_inputs={"a": [0]},
        num_common_prefix_blocks=1,
        finished_req_ids={"x", "y"},
        preempted_req_ids={"z"},
        free_encoder_mm_hashes=["old"],
        grammar_bitmask=np.arange(6, dtype=np.int32).reshape(2, 3) - 3,
        structured_req_ids=["a", "b"],
    )


def _assert_same(a, b):
    """Deep equality that understands tensors and arrays (dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif hasattr(a, "__slots__") and not isinstance(a, (str, bytes)):
        assert type(a) is type(b)
        for name in a.__slots__:
            _assert_same(getattr(a, name), getattr(b, name))
    else:
        assert a == b and type(a) is type(b), (a, b)


class _Wire:
    """An engine encoder and a worker decoder joined by serialized bytes, as
    over the ExecuteModel stream."""

    def __init__(self):
        self.encoder = step_stream.SchedulerOutputEncoder()
        self.decoder = step_stream.SchedulerOutputDecoder()
        self.step_id = 0

    def send(self, so: SchedulerOutput) -> tuple[worker_pb2.SchedulerOutput, SchedulerOutput]:
        self.step_id += 1
        wire = self.encoder.encode(so, self.step_id).SerializeToString()
        msg = worker_pb2.SchedulerOutput.FromString(wire)
        assert msg.step_id == self.step_id
        return msg, self.decoder.decode(msg)


def _reply_round_trip(
    out: ModelRunnerOutput, order=None, decoder=None
) -> tuple[worker_pb2.ModelRunnerOutput, ModelRunnerOutput]:
    wire = step_stream.model_runner_output_to_proto(out, 3, order).SerializeToString()
    msg = worker_pb2.ModelRunnerOutput.FromString(wire)
    return msg, (decoder or step_stream.ModelRunnerOutputDecoder()).decode(msg, order)


def _step(cached: list[str], nct: list[int], blocks=None, **kw) -> SchedulerOutput:
    blocks = blocks or [[] for _ in cached]
    return SchedulerOutput(
        [], CachedRequestData(list(cached), blocks, nct), {r: 1 for r in cached}, len(cached), **kw
    )


def _new(rid: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(rid, prompt, [], SamplingParams(max_tokens=4), blocks, 0)


def test_scheduler_output_round_trips_through_bytes_including_mm_tensors():
    wire = _Wire()
    # c, d and e were sent before: they are cached requests in the step under test.
    wire.send(
        SchedulerOutput(
            [_new(r, [1, 2], [1]) for r in "cde"], CachedRequestData(), {r: 2 for r in "cde"}, 6
        )
    )
    so = _scheduler_output()
    msg, back = wire.send(so)
    _assert_same(so, back)
    # The dict order of num_scheduled_tokens is the order requests run in.
    assert list(back.num_scheduled_tokens) == ["c", "a", "d", "b", "e"]
    assert msg.scheduled_handles  # not the canonical order: sent explicitly


def test_steady_decode_steps_name_requests_by_handle_and_pack_everything():
    wire = _Wire()
    ids = [f"request-{i}" for i in range(5)]
    wire.send(
        SchedulerOutput(
            [_new(r, [1, 2, 3], [1]) for r in ids], CachedRequestData(), {r: 3 for r in ids}, 15
        )
    )
    for step in range(3):
        so = _step(ids, [3 + step] * 5, [[], [9 + step], [], [], [4, 5]] if step else None)
        msg, back = wire.send(so)
        _assert_same(so, back)
        # No request id travels on a decode step, only int32 arrays.
        assert not any(r.encode() in msg.SerializeToString() for r in ids)
        assert not msg.scheduled_handles  # the order is implied by the cached requests
    out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[4], [5], [6], [7], [8]])
    reply, back = _reply_round_trip(out, ids)
    assert not reply.req_ids and not reply.sampled_token_ids.counts  # one packed array
    _assert_same(out, back)
    with pytest.raises(ValueError, match="scheduled_req_ids"):
        step_stream.ModelRunnerOutputDecoder().decode(reply)


def test_a_step_repeating_the_last_ones_requests_and_counts_sends_only_its_deltas():
    wire = _Wire()
    ids = [f"request-{i}" for i in range(4)]
    wire.send(
        SchedulerOutput(
            [_new(r, [1, 2, 3], [1]) for r in ids], CachedRequestData(), {r: 1 for r in ids}, 4
        )
    )
    # The first decode step repeats the prefill step's order and counts (one
    # token each), so it is already a repeat, as is every step after it.
    for step, blocks in enumerate([None, [[], [7], [], []], None]):
        so = _step(ids, [1 + step] * 4, blocks)
        msg, back = wire.send(so)
        _assert_same(so, back)
        assert msg.repeats_last_step
        assert not msg.scheduled_cached_reqs.handles and not msg.num_scheduled_tokens
    # Any change of order, count or membership is sent in full.
    for so in (
        _step(ids[::-1], [4] * 4),
        _step(ids[:3], [5] * 3),
        SchedulerOutput(
            [], CachedRequestData(ids[:3], [[]] * 3, [6] * 3), {r: 2 for r in ids[:3]}, 6
        ),
    ):
        msg, back = wire.send(so)
        _assert_same(so, back)
        assert not msg.repeats_last_step


def test_a_repeat_without_a_last_step_is_refused():
    msg = worker_pb2.SchedulerOutput(repeats_last_step=True)
    with pytest.raises(ValueError, match="no last step"):
        step_stream.SchedulerOutputDecoder().decode(msg)


def test_random_step_sequences_round_trip_exactly():
    """A naive model of a scheduler's steps (admit, run in changing or
    repeated order, chunk, preempt, resume, finish, reuse ids) through one
    encoder and decoder: every step decodes to what was encoded."""
    rng = random.Random(7)
    wire = _Wire()
    sent: set[str] = set()  # announced to the worker, not finished
    preempted: set[str] = set()  # announced, waiting to resume
    counter = 0
    last: list[str] = []
    repeats = 0
    for _ in range(400):
        finished = set(rng.sample(sorted(sent), k=min(len(sent), rng.choice([0, 0, 0, 1, 2]))))
        sent -= finished
        preempted -= finished
        running = [r for r in last if r in sent and r not in preempted]
        if running and rng.random() < 0.1:
            victim = rng.choice(running)
            preempted.add(victim)
            running.remove(victim)
            pre = {victim}
        else:
            pre = set()
        if rng.random() < 0.2:
            rng.shuffle(running)
        resumed = [r for r in sorted(preempted) if rng.random() < 0.3]
        preempted -= set(resumed)
        new = []
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            counter += 1
            # Sometimes a finished id comes back as a new request.
            rid = rng.choice(sorted(finished)) if finished and rng.random() < 0.3 else f"r{counter}"
            finished.discard(rid)
            new.append(_new(rid, [counter % 50 + 1] * rng.randint(1, 5), [counter]))
        cached_ids = running + resumed
        blocks = [[rng.randrange(100)] if rng.random() < 0.1 else [] for _ in running]
        blocks += [[rng.randrange(100) for _ in range(3)] for _ in resumed]
        steady = rng.random() < 0.7
        nst = {r: 1 if steady else rng.randint(1, 4) for r in cached_ids}
        nst.update({r.req_id: len(r.prompt_token_ids) for r in new})
        so = SchedulerOutput(
            new,
            CachedRequestData(
                cached_ids,
                blocks,
                [rng.randrange(500) for _ in cached_ids],
                {r: [1, 2, 3] for r in resumed},
            ),
            nst,
            sum(nst.values()),
            finished_req_ids=finished,
            preempted_req_ids=pre,
        )
        msg, back = wire.send(so)
        _assert_same(so, back)
        repeats += msg.repeats_last_step
        sent |= {r.req_id for r in new}
        last = list(nst)
    assert repeats > 20  # the sequence exercised the repeat path as well


def test_handles_follow_requests_through_finish_preempt_resume_and_id_reuse():
    wire = _Wire()
    steps = [
        SchedulerOutput(
            [_new("a", [1, 2], [1]), _new("b", [3], [2])], CachedRequestData(), {"a": 2, "b": 1}, 3
        ),
        _step(["a", "b"], [2, 1], [[3], []]),
        _step(["a"], [3], preempted_req_ids={"b"}),
        # a finishes and a new request reuses its id in the same step; x was
        # aborted before it was ever sent.
        SchedulerOutput(
            [_new("a", [7, 7, 7], [5]), _new("c", [5, 6], [4])],
            CachedRequestData(),
            {"a": 3, "c": 2},
            5,
            finished_req_ids={"a", "x"},
        ),
        # b resumes with its whole table and tokens.
        SchedulerOutput(
            [],
            CachedRequestData(["a", "c", "b"], [[], [], [6, 7]], [3, 2, 0], {"b": [3, 8]}),
            {"a": 1, "c": 1, "b": 2},
            4,
        ),
        _step(["a", "b"], [4, 2], finished_req_ids={"c"}),
        # c's handle is free again and goes to a new request d.
        SchedulerOutput(
            [_new("d", [9], [8])],
            CachedRequestData(["a", "b"], [[], []], [5, 3]),
            {"a": 1, "b": 1, "d": 1},
            3,
        ),
    ]
    msgs = []
    for so in steps:
        msg, back = wire.send(so)
        _assert_same(so, back)
        msgs.append(msg)

    def handle(step: int, rid: str) -> int:
        return next(m.handle for m in msgs[step].scheduled_new_reqs if m.req_id == rid)

    assert list(msgs[3].finished_unsent_req_ids) == ["x"]  # never sent: goes by name
    assert convert._i32_list(msgs[3].finished_handles) == [handle(0, "a")]
    assert handle(3, "a") != handle(0, "a")  # the reused id got a fresh handle
    assert convert._i32_list(msgs[2].preempted_handles) == [handle(0, "b")]
    assert handle(6, "d") == handle(3, "c")  # retired handles come back


def test_a_step_naming_an_unsent_request_is_refused():
    with pytest.raises(ValueError, match="'ghost'"):
        step_stream.SchedulerOutputEncoder().encode(_step(["ghost"], [1]))
    msg = worker_pb2.SchedulerOutput(
        scheduled_cached_reqs=worker_pb2.CachedRequests(handles=convert._i32([7]))
    )
    with pytest.raises(ValueError, match="never announced"):
        step_stream.SchedulerOutputDecoder().decode(msg)


def test_empty_scheduler_output_round_trips():
    so = SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"gone"})
    _assert_same(so, _Wire().send(so)[1])


def test_model_runner_output_round_trips_with_logprobs_drafts_and_pooler():
    out = ModelRunnerOutput(
        req_ids=["a", "b", "c"],
        req_id_to_index={"a": 0, "b": 1, "c": 2},
        sampled_token_ids=[[5], [], [7, 8, 9]],
        logprobs=[[{5: -0.5, 1: -1.25}], None, [{7: -0.125}, {8: -2.0}, {9: -3.5}]],
        pooler_output=[torch.ones(3), None, torch.zeros(2, dtype=torch.float16)],
        spec_token_ids=[[1, 2], [], [3]],
        prompt_logprobs={"b": PromptLogprobs(17, [{4: -0.5, 6: -0.25}, {9: -3.0}])},
    )
    _assert_same(out, _reply_round_trip(out)[1])
    decoder = step_stream.ModelRunnerOutputDecoder()
    for sampled in ([[4]], [[]], [[1, 2]]):  # one decoder across steps of varying shape
        plain = ModelRunnerOutput(["a"], {"a": 0}, sampled)
        _assert_same(plain, _reply_round_trip(plain, ["a"], decoder)[1])
    rows = [[] for _ in range(9)] + [[3, 4]]  # mostly empty: the sparse form
    sparse = ModelRunnerOutput([str(i) for i in range(10)], {str(i): i for i in range(10)}, rows)
    msg, back = _reply_round_trip(sparse)
    assert msg.sampled_token_ids.sparse
    _assert_same(sparse, back)


def test_token_ids_travel_as_packed_little_endian_int32():
    so = SchedulerOutput([_new("r", [1, 2, 70000], [5, 6])], CachedRequestData(), {"r": 3}, 3)
    new = _Wire().send(so)[0].scheduled_new_reqs[0]
    # Byte for byte what a packed `repeated sfixed32` holds.
    assert new.prompt_token_ids == struct.pack("<3i", 1, 2, 70000)
    assert new.block_ids == struct.pack("<2i", 5, 6)
    with pytest.raises(ValueError, match="int32"):
        _Wire().send(SchedulerOutput([_new("r", [1 << 40], [1])], CachedRequestData(), {"r": 1}, 1))


def test_unset_sampling_fields_take_engine_defaults_and_bad_values_name_the_field():
    assert convert.sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        convert.sampling_params_from_proto(common_pb2.SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="structured"):
        convert.sampling_params_from_proto(
            common_pb2.SamplingParams(structured=common_pb2.StructuredOutput())
        )


def test_every_sampling_field_round_trips():
    # Every field set to a non-default value: a field the converter forgets
    # comes back as its default and fails the comparison.
    params = SamplingParams(
        max_tokens=9,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=11,
        stop_token_ids=[3],
        ignore_eos=True,
        logprobs=2,
        structured={"regex": "[ab]+"},
        stop=["END", "\n\n"],
        include_stop_str_in_output=True,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias={7: 2.5, 9: -100.0},
        allowed_token_ids=[7, 9, 11],
        bad_words=["darn"],
        bad_words_token_ids=[[4, 5], [6]],
        n=3,
        prompt_logprobs=1,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        truncate_prompt_tokens=100,
    )
    defaults = SamplingParams()
    unchanged = [f for f in params.to_dict() if getattr(params, f) == getattr(defaults, f)]
    assert unchanged == []
    msg = common_pb2.SamplingParams()
    convert.sampling_params_to_proto(params, msg)
    back = convert.sampling_params_from_proto(
        common_pb2.SamplingParams.FromString(msg.SerializeToString())
    )
    assert back == params


def test_configs_round_trip():
    cache = CacheConfig(
        block_size=8,
        num_blocks=100,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=None,
        hash_algo="sha256",
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=3,
        max_model_len=200,
        long_prefill_token_threshold=9,
        policy="priority",
        async_scheduling=True,
    )
    msg = worker_pb2.InitializeRequest(model="m")
    convert.configs_to_proto(cache, sched, msg)
    assert convert.configs_from_proto(msg) == (cache, sched)
