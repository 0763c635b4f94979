"""The one place where engine dataclasses become protobuf and back.

Tensors (multimodal pixel values, grammar bitmasks) travel as raw bytes plus
dtype and shape; torch is imported only when a tensor is actually met, so the
scheduler side (core) stays torch-free.
"""
from __future__ import annotations

import json
from itertools import chain, islice
from numbers import Integral, Real
from typing import Any

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.outputs import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                      SchedulerOutput)
from tokenbudget.core.request import MultiModalFeature
from tokenbudget.core.sampling_params import (STRUCTURED_KINDS, SamplingParams,
                                              StructuredOutputParams)
from tokenbudget.proto import common_pb2, worker_pb2

# -- tensors and loose values -------------------------------------------------------


def tensor_to_proto(value: Any, out: common_pb2.Tensor) -> None:
    """Fill ``out`` from a torch tensor or a numpy array."""
    if type(value).__module__ == "numpy":
        import numpy as np

        arr = np.ascontiguousarray(value)
        out.dtype = arr.dtype.name
        out.shape.extend(arr.shape)
        out.data = arr.tobytes()
        out.is_numpy = True
        return
    import torch

    t = value.detach().to("cpu").contiguous()
    out.dtype = str(t.dtype).removeprefix("torch.")
    out.shape.extend(t.shape)
    # A uint8 view works for every dtype, bfloat16 included (numpy has none).
    out.data = t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_proto(msg: common_pb2.Tensor) -> Any:
    shape = tuple(msg.shape)
    if msg.is_numpy:
        import numpy as np

        return np.frombuffer(msg.data, dtype=msg.dtype).reshape(shape).copy()
    import torch

    dtype = getattr(torch, msg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor dtype {msg.dtype!r} is not a torch dtype")
    if not msg.data:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _is_tensor(value: Any) -> bool:
    module = type(value).__module__
    return (module == "numpy" and type(value).__name__ == "ndarray") or module.startswith("torch")


def value_to_proto(value: Any, out: common_pb2.Value) -> None:
    """Encode None, bool, int, float, str, bytes, tensors, lists/tuples and
    str-keyed dicts (nested). Tuples come back as lists."""
    if value is None:
        return  # no kind set
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, Integral):
        out.int_value = int(value)
    elif isinstance(value, Real):
        out.float_value = float(value)
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out.bytes_value = bytes(value)
    elif _is_tensor(value):
        tensor_to_proto(value, out.tensor)
    elif isinstance(value, (list, tuple)):
        items = out.list_value.items
        out.list_value.SetInParent()
        for v in value:
            value_to_proto(v, items.add())
    elif isinstance(value, dict):
        out.map_value.SetInParent()
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"only str dict keys can be serialized, got {k!r}")
            value_to_proto(v, out.map_value.items[k])
    else:
        raise TypeError(f"cannot serialize a {type(value).__name__} into a Value")


def value_from_proto(msg: common_pb2.Value) -> Any:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "tensor":
        return tensor_from_proto(msg.tensor)
    if kind == "list_value":
        return [value_from_proto(v) for v in msg.list_value.items]
    if kind == "map_value":
        return {k: value_from_proto(v) for k, v in msg.map_value.items.items()}
    return getattr(msg, kind)


# -- sampling params ----------------------------------------------------------------

_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k",
                             "min_p", "seed", "ignore_eos", "logprobs")


def sampling_params_to_proto(sp: SamplingParams, out: common_pb2.SamplingParams) -> None:
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(sp, name)
        if value is not None:
            setattr(out, name, value)
    out.stop_token_ids.extend(sp.stop_token_ids)
    if sp.structured is not None:
        structured_to_proto(sp.structured, out.structured)


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; a bad value raises
    ValueError naming the field (SamplingParams validates itself)."""
    kwargs: dict[str, Any] = {n: getattr(msg, n) for n in _OPTIONAL_SAMPLING_FIELDS
                              if msg.HasField(n)}
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.HasField("structured"):
        kwargs["structured"] = structured_from_proto(msg.structured)
    return SamplingParams(**kwargs)


def structured_to_proto(so: StructuredOutputParams, out: common_pb2.StructuredOutput) -> None:
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)
    if kind == "choice":
        out.choice.choices.extend(value)
    else:
        setattr(out, kind, value)


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutputParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("sampling_params.structured: set one of " + ", ".join(STRUCTURED_KINDS))
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputParams(**{kind: value})


# -- configs (Initialize) -----------------------------------------------------------

_CACHE_FIELDS = ("block_size", "enable_prefix_caching", "gpu_memory_utilization", "hash_algo")
_CACHE_OPTIONAL = ("num_blocks", "kv_cache_memory_bytes")
_SCHED_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                 "long_prefill_token_threshold", "policy", "encoder_compute_budget",
                 "encoder_cache_size", "num_speculative_tokens", "async_scheduling")


def configs_to_proto(cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                     out: worker_pb2.InitializeRequest) -> None:
    for name in _CACHE_FIELDS:
        setattr(out.cache_config, name, getattr(cache_config, name))
    for name in _CACHE_OPTIONAL:
        if getattr(cache_config, name) is not None:
            setattr(out.cache_config, name, getattr(cache_config, name))
    for name in _SCHED_FIELDS:
        setattr(out.scheduler_config, name, getattr(scheduler_config, name))


def configs_from_proto(msg: worker_pb2.InitializeRequest) -> tuple[CacheConfig, SchedulerConfig]:
    cc = msg.cache_config
    cache = CacheConfig(**{n: getattr(cc, n) for n in _CACHE_FIELDS},
                        **{n: getattr(cc, n) if cc.HasField(n) else None for n in _CACHE_OPTIONAL})
    sched = SchedulerConfig(**{n: getattr(msg.scheduler_config, n) for n in _SCHED_FIELDS})
    return cache, sched


# -- ragged lists ---------------------------------------------------------------------


def _ragged_to_proto(lists: list[list[int]], out: worker_pb2.RaggedIds) -> None:
    out.counts.extend([len(x) for x in lists])
    out.flat.extend(chain.from_iterable(lists))


def _sparse_ragged_to_proto(lists: list[list[int]], out: worker_pb2.RaggedIds) -> None:
    rows = [i for i, x in enumerate(lists) if x]
    out.num_lists = len(lists)
    out.rows.extend(rows)
    out.counts.extend([len(lists[i]) for i in rows])
    out.flat.extend(chain.from_iterable(lists[i] for i in rows))


def _ragged_from_proto(msg: worker_pb2.RaggedIds) -> list[list[int]]:
    # Decode steps are the hot path: every list one token, or (sparse) almost
    # every list empty; splitting generically costs several times more.
    counts = msg.counts
    if msg.num_lists:
        lists: list[list[int]] = [[] for _ in range(msg.num_lists)]
        it = iter(msg.flat)
        for row, n in zip(msg.rows, counts):
            lists[row] = list(islice(it, n))
        return lists
    if not msg.flat:
        return [[] for _ in counts]
    if len(msg.flat) == len(counts) and max(counts) == 1:  # sum n, none > 1: all ones
        return [[x] for x in msg.flat]
    it = iter(msg.flat)
    return [list(islice(it, n)) for n in counts]


def _id_lists_to_proto(d: dict[str, list[int]], out) -> None:
    for key, ids in d.items():
        out[key].ids.extend(ids)


def _id_lists_from_proto(m) -> dict[str, list[int]]:
    return {key: list(v.ids) for key, v in m.items()}


# -- SchedulerOutput --------------------------------------------------------------------


def scheduler_output_to_proto(so: SchedulerOutput, step_id: int = 0) -> worker_pb2.SchedulerOutput:
    cached = so.scheduled_cached_reqs
    msg = worker_pb2.SchedulerOutput(
        step_id=step_id,
        num_scheduled_tokens=so.num_scheduled_tokens.values(),
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        num_common_prefix_blocks=so.num_common_prefix_blocks,
        finished_req_ids=so.finished_req_ids,
        preempted_req_ids=so.preempted_req_ids,
        free_encoder_mm_hashes=so.free_encoder_mm_hashes,
        structured_req_ids=so.structured_req_ids,
    )
    if list(so.num_scheduled_tokens) != _canonical_order(so):
        msg.scheduled_req_ids.extend(so.num_scheduled_tokens)
    for r in so.scheduled_new_reqs:
        _new_request_to_proto(r, msg.scheduled_new_reqs.add())
    out = msg.scheduled_cached_reqs
    out.req_ids.extend(cached.req_ids)
    _sparse_ragged_to_proto(cached.new_block_ids, out.new_block_ids)
    out.num_computed_tokens.extend(cached.num_computed_tokens)
    _id_lists_to_proto(cached.resumed_token_ids, out.resumed_token_ids)
    _id_lists_to_proto(so.scheduled_spec_decode_tokens, msg.scheduled_spec_decode_tokens)
    _id_lists_to_proto(so.scheduled_encoder_inputs, msg.scheduled_encoder_inputs)
    if so.grammar_bitmask is not None:
        tensor_to_proto(so.grammar_bitmask, msg.grammar_bitmask)
    return msg


def scheduler_output_from_proto(msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
    c = msg.scheduled_cached_reqs
    cached = CachedRequestData(
        req_ids=list(c.req_ids),
        new_block_ids=_ragged_from_proto(c.new_block_ids),
        num_computed_tokens=list(c.num_computed_tokens),
        resumed_token_ids=_id_lists_from_proto(c.resumed_token_ids),
    )
    new_reqs = [_new_request_from_proto(r) for r in msg.scheduled_new_reqs]
    order = msg.scheduled_req_ids or cached.req_ids + [r.req_id for r in new_reqs]
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(zip(order, msg.num_scheduled_tokens)),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=_id_lists_from_proto(msg.scheduled_spec_decode_tokens),
        scheduled_encoder_inputs=_id_lists_from_proto(msg.scheduled_encoder_inputs),
        num_common_prefix_blocks=msg.num_common_prefix_blocks,
        finished_req_ids=set(msg.finished_req_ids),
        preempted_req_ids=set(msg.preempted_req_ids),
        free_encoder_mm_hashes=list(msg.free_encoder_mm_hashes),
        grammar_bitmask=(tensor_from_proto(msg.grammar_bitmask)
                         if msg.HasField("grammar_bitmask") else None),
        structured_req_ids=list(msg.structured_req_ids),
    )


def _canonical_order(so: SchedulerOutput) -> list[str]:
    return so.scheduled_cached_reqs.req_ids + [r.req_id for r in so.scheduled_new_reqs]


def _new_request_to_proto(r: NewRequestData, out: worker_pb2.NewRequest) -> None:
    out.req_id = r.req_id
    out.prompt_token_ids.extend(r.prompt_token_ids)
    for f in r.mm_features:
        fm = out.mm_features.add(mm_hash=f.mm_hash, offset=f.offset, length=f.length)
        value_to_proto(f.data, fm.data)
    sampling_params_to_proto(r.sampling_params, out.sampling_params)
    out.block_ids.extend(r.block_ids)
    out.num_computed_tokens = r.num_computed_tokens
    if r.lora_id is not None:
        out.lora_id = r.lora_id


def _new_request_from_proto(m: worker_pb2.NewRequest) -> NewRequestData:
    features = [MultiModalFeature(f.mm_hash, f.offset, f.length, value_from_proto(f.data))
                for f in m.mm_features]
    return NewRequestData(
        req_id=m.req_id, prompt_token_ids=list(m.prompt_token_ids), mm_features=features,
        sampling_params=sampling_params_from_proto(m.sampling_params),
        block_ids=list(m.block_ids), num_computed_tokens=m.num_computed_tokens,
        lora_id=m.lora_id if m.HasField("lora_id") else None)


# -- ModelRunnerOutput ------------------------------------------------------------------


def model_runner_output_to_proto(out: ModelRunnerOutput, step_id: int = 0,
                                 scheduled_req_ids: list[str] | None = None,
                                 ) -> worker_pb2.ModelRunnerOutput:
    """``scheduled_req_ids``: the step's order (list(num_scheduled_tokens));
    rows in that order are sent without their ids."""
    msg = worker_pb2.ModelRunnerOutput(step_id=step_id)
    if out.req_ids != scheduled_req_ids:
        msg.req_ids.extend(out.req_ids)
    _ragged_to_proto(out.sampled_token_ids, msg.sampled_token_ids)
    if out.logprobs is not None:
        msg.has_logprobs = True
        for per_req in out.logprobs:
            rl = msg.logprobs.add(present=per_req is not None)
            for per_token in per_req or ():
                rl.tokens.add(token_ids=per_token.keys(), logprobs=per_token.values())
    if out.pooler_output is not None:
        msg.has_pooler_output = True
        for v in out.pooler_output:
            value_to_proto(v, msg.pooler_output.add())
    if out.spec_token_ids is not None:
        msg.has_spec_token_ids = True
        _ragged_to_proto(out.spec_token_ids, msg.spec_token_ids)
    return msg


def model_runner_output_from_proto(msg: worker_pb2.ModelRunnerOutput,
                                   scheduled_req_ids: list[str] | None = None,
                                   ) -> ModelRunnerOutput:
    """``scheduled_req_ids`` must be what the sender was given (see to_proto)."""
    req_ids = list(msg.req_ids)
    if not req_ids and msg.sampled_token_ids.counts:
        if scheduled_req_ids is None:
            raise ValueError("this ModelRunnerOutput omits its req_ids: pass the step's "
                             "scheduled_req_ids")
        req_ids = list(scheduled_req_ids)
    logprobs = None
    if msg.has_logprobs:
        logprobs = [[dict(zip(t.token_ids, t.logprobs)) for t in rl.tokens] if rl.present
                    else None for rl in msg.logprobs]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=_ragged_from_proto(msg.sampled_token_ids),
        logprobs=logprobs,
        pooler_output=([value_from_proto(v) for v in msg.pooler_output]
                       if msg.has_pooler_output else None),
        spec_token_ids=(_ragged_from_proto(msg.spec_token_ids)
                        if msg.has_spec_token_ids else None),
    )
