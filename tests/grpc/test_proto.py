"""The protobuf layer: generated code is fresh, and conversion round-trips exactly."""
from __future__ import annotations

import filecmp

import numpy as np
import pytest
import torch

from tokenbudget.core import (CacheConfig, CachedRequestData, ModelRunnerOutput,
                              MultiModalFeature, NewRequestData, SamplingParams,
                              SchedulerConfig, SchedulerOutput)
from tokenbudget.proto import common_pb2, convert, worker_pb2
from tokenbudget.proto.generate import PROTO_DIR, generate


def test_committed_generated_code_matches_the_proto_sources(tmp_path):
    written = generate(tmp_path)
    assert written
    for fresh in written:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed; run python -m tokenbudget.proto.generate"
        assert filecmp.cmp(fresh, committed, shallow=False), \
            f"{fresh.name} is stale; run python -m tokenbudget.proto.generate"


def _scheduler_output() -> SchedulerOutput:
    image = {"pixel_values": torch.randn(16, 12), "image_grid_thw": torch.tensor([[1, 4, 4]]),
             "deepstack": [torch.randn(2, 3).to(torch.bfloat16)], "note": "x", "scale": 0.5}
    new = [
        NewRequestData("a", [1, 2, 3, 4, 5], [MultiModalFeature("h0", 1, 3, image)],
                       SamplingParams(max_tokens=7, temperature=0.0, top_k=5, seed=3,
                                      stop_token_ids=[9, 8], logprobs=2,
                                      structured={"choice": ["yes", "no"]}),
                       [1, 2], 0),
        NewRequestData("b", [7] * 40, [], SamplingParams(structured={"json_schema": '{"type": "object"}'}),
                       [3, 4, 5], 16, lora_id=2),
    ]
    cached = CachedRequestData(req_ids=["c", "d", "e"], new_block_ids=[[], [6], [7, 8, 9]],
                               num_computed_tokens=[33, 17, 0],
                               resumed_token_ids={"e": [5, 6, 7, 8]})
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached,
        num_scheduled_tokens={"c": 1, "a": 5, "d": 3, "b": 24, "e": 4},
        total_num_scheduled_tokens=37, scheduled_spec_decode_tokens={"d": [4, 5]},
        scheduled_encoder_inputs={"a": [0]}, num_common_prefix_blocks=1,
        finished_req_ids={"x", "y"}, preempted_req_ids={"z"}, free_encoder_mm_hashes=["old"],
        grammar_bitmask=np.arange(6, dtype=np.int32).reshape(2, 3) - 3,
        structured_req_ids=["a", "b"])


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


def test_scheduler_output_round_trips_through_bytes_including_mm_tensors():
    so = _scheduler_output()
    wire = convert.scheduler_output_to_proto(so, step_id=12).SerializeToString()
    msg = worker_pb2.SchedulerOutput.FromString(wire)
    assert msg.step_id == 12
    back = convert.scheduler_output_from_proto(msg)
    _assert_same(so, back)
    # The dict order of num_scheduled_tokens is the order requests run in.
    assert list(back.num_scheduled_tokens) == ["c", "a", "d", "b", "e"]


def test_steady_decode_steps_send_each_request_id_once_each_way():
    ids = ["r1", "r2", "r3"]
    so = SchedulerOutput([], CachedRequestData(ids, [[], [9], []], [5, 6, 7]),
                         {r: 1 for r in ids}, 3)
    msg = convert.scheduler_output_to_proto(so)
    assert not msg.scheduled_req_ids  # implied by the cached requests' order
    _assert_same(so, convert.scheduler_output_from_proto(msg))
    out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[4], [5], [6]])
    reply = convert.model_runner_output_to_proto(out, 1, ids)
    assert not reply.req_ids
    _assert_same(out, convert.model_runner_output_from_proto(reply, ids))
    with pytest.raises(ValueError, match="scheduled_req_ids"):
        convert.model_runner_output_from_proto(reply)


def test_empty_scheduler_output_round_trips():
    so = SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"gone"})
    _assert_same(so, convert.scheduler_output_from_proto(convert.scheduler_output_to_proto(so)))


def test_model_runner_output_round_trips_with_logprobs_drafts_and_pooler():
    out = ModelRunnerOutput(
        req_ids=["a", "b", "c"], req_id_to_index={"a": 0, "b": 1, "c": 2},
        sampled_token_ids=[[5], [], [7, 8, 9]],
        logprobs=[[{5: -0.5, 1: -1.25}], None, [{7: -0.125}, {8: -2.0}, {9: -3.5}]],
        pooler_output=[torch.ones(3), None, torch.zeros(2, dtype=torch.float16)],
        spec_token_ids=[[1, 2], [], [3]])
    wire = convert.model_runner_output_to_proto(out).SerializeToString()
    _assert_same(out, convert.model_runner_output_from_proto(
        worker_pb2.ModelRunnerOutput.FromString(wire)))
    plain = ModelRunnerOutput(["a"], {"a": 0}, [[4]])
    _assert_same(plain, convert.model_runner_output_from_proto(
        convert.model_runner_output_to_proto(plain)))


def test_token_ids_travel_packed():
    so = SchedulerOutput([], CachedRequestData(["r"], [[1, 2, 3]], [5]), {"r": 1}, 1)
    msg = convert.scheduler_output_to_proto(so)
    ids = msg.scheduled_cached_reqs.new_block_ids.flat
    # Packed varints: tag + length + 3 one-byte values, not 3 tagged fields.
    assert len(worker_pb2.RaggedIds(flat=ids).SerializeToString()) == 5


def test_unset_sampling_fields_take_engine_defaults_and_bad_values_name_the_field():
    assert convert.sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        convert.sampling_params_from_proto(common_pb2.SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="structured"):
        convert.sampling_params_from_proto(
            common_pb2.SamplingParams(structured=common_pb2.StructuredOutput()))


def test_configs_round_trip():
    cache = CacheConfig(block_size=8, num_blocks=100, enable_prefix_caching=False,
                        kv_cache_memory_bytes=None, hash_algo="sha256")
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3, max_model_len=200,
                            long_prefill_token_threshold=9, policy="priority",
                            async_scheduling=True)
    msg = worker_pb2.InitializeRequest(model="m")
    convert.configs_to_proto(cache, sched, msg)
    assert convert.configs_from_proto(msg) == (cache, sched)
