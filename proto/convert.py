"""Engine dataclasses to protobuf and back, statelessly: values and tensors,
sampling, structured-output and pooling params, configs, KV events, and the
int32 arrays the worker protocol packs ids into. The step stream (a
SchedulerOutput or ModelRunnerOutput per step, with request handles) is
proto/step_stream.py.

Tensors (multimodal pixel values, grammar bitmasks) travel as raw bytes plus
dtype and shape; torch is imported only when a tensor is actually met, so the
scheduler side (core) stays torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from array import array
from collections.abc import Collection, Mapping
from itertools import chain, compress, islice, repeat
from numbers import Integral, Real
from typing import Any

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.lora import LoRAConfig
from tokenbudget.core.spec_config import SpeculativeConfig
from tokenbudget.core.pooling_params import PoolingParams
from tokenbudget.core.sampling_params import (
    STRUCTURED_KINDS,
    SamplingParams,
    StructuredOutputParams,
)
from tokenbudget.core.kv.events import AllCleared, BlockRemoved, BlockStored, KVEventBatch
from tokenbudget.proto import common_pb2, generate_pb2, worker_pb2

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

_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "logprobs",
    "include_stop_str_in_output",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "n",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
)
# Repeated fields whose empty value means unset (None or the default).
_LIST_SAMPLING_FIELDS = ("stop_token_ids", "stop", "allowed_token_ids", "bad_words")


def sampling_params_to_proto(sp: SamplingParams, out: common_pb2.SamplingParams) -> None:
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(sp, name)
        if value is not None:
            setattr(out, name, value)
    for name in _LIST_SAMPLING_FIELDS:
        values = getattr(sp, name)
        if values:
            getattr(out, name).extend(values)
    if sp.logit_bias:
        out.logit_bias.update(sp.logit_bias)
    for seq in sp.bad_words_token_ids or ():
        out.bad_words_token_ids.add(ids=seq)
    if sp.structured is not None:
        structured_to_proto(sp.structured, out.structured)


def sampling_params_from_proto(
    msg: common_pb2.SamplingParams, defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """Unset fields take ``defaults`` (the model's generation_config values,
    by SamplingParams name), then SamplingParams' own; a bad value raises
    ValueError naming the field (SamplingParams validates itself)."""
    kwargs: dict[str, Any] = dict(defaults or {})
    kwargs.update((n, getattr(msg, n)) for n in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(n))
    for name in _LIST_SAMPLING_FIELDS:
        values = getattr(msg, name)
        if values:
            kwargs[name] = list(values)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.bad_words_token_ids:
        kwargs["bad_words_token_ids"] = [list(t.ids) for t in msg.bad_words_token_ids]
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
        raise ValueError("structured: set one of " + ", ".join(STRUCTURED_KINDS))
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputParams(**{kind: value})


# -- configs (Initialize) -----------------------------------------------------------

_CACHE_FIELDS = (
    "block_size",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "hash_algo",
    "kv_load_blocks_per_step",
    "enable_kv_cache_events",
    # Derived (not a setting), but the workers act on it: they register their KV with it.
    "kv_transfer_backend",
)
_CACHE_OPTIONAL = (
    "num_blocks",
    "kv_cache_memory_bytes",
    "kv_offload_memory_bytes",
    "num_offload_blocks",
)
# The SchedulerConfig fields worker.proto's SchedulerConfig carries as scalars
# (the worker sizes its buffers by them; speculative_config is a message of its own).
_SCHED_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(SchedulerConfig)
    if f.name
    in {d.name for d in worker_pb2.SchedulerConfig.DESCRIPTOR.fields if d.message_type is None}
)
_SPEC_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def configs_to_proto(
    cache_config: CacheConfig, scheduler_config: SchedulerConfig, out: worker_pb2.InitializeRequest
) -> None:
    for name in _CACHE_FIELDS:
        setattr(out.cache_config, name, getattr(cache_config, name))
    for name in _CACHE_OPTIONAL:
        if getattr(cache_config, name) is not None:
            setattr(out.cache_config, name, getattr(cache_config, name))
    for name in _SCHED_FIELDS:
        setattr(out.scheduler_config, name, getattr(scheduler_config, name))
    spec = scheduler_config.speculative_config
    if spec is not None:
        for name in _SPEC_FIELDS:
            setattr(out.scheduler_config.speculative_config, name, getattr(spec, name))


def configs_from_proto(msg: worker_pb2.InitializeRequest) -> tuple[CacheConfig, SchedulerConfig]:
    """Raises ValueError naming the message's field (``cache_config.block_size ...``)."""
    cc = msg.cache_config
    try:
        cache = CacheConfig(
            **{n: getattr(cc, n) for n in _CACHE_FIELDS},
            **{n: getattr(cc, n) if cc.HasField(n) else None for n in _CACHE_OPTIONAL},
        )
    except ValueError as exc:
        raise ValueError(f"cache_config.{exc}") from None
    sc = msg.scheduler_config
    try:
        spec = None
        if sc.HasField("speculative_config"):
            fields = {n: getattr(sc.speculative_config, n) for n in _SPEC_FIELDS}
            spec = SpeculativeConfig(**fields)
        sched = SchedulerConfig(
            **{n: getattr(sc, n) for n in _SCHED_FIELDS}, speculative_config=spec
        )
    except ValueError as exc:
        raise ValueError(f"scheduler_config.{exc}") from None
    return cache, sched


def lora_config_to_proto(config: LoRAConfig | None, out: worker_pb2.InitializeRequest) -> None:
    if config is not None:
        lc = out.lora_config
        lc.max_loras, lc.max_lora_rank = config.max_loras, config.max_lora_rank
        lc.max_cpu_loras = config.num_cpu_loras


def lora_config_from_proto(msg: worker_pb2.InitializeRequest) -> LoRAConfig | None:
    """None when absent (LoRA off); ValueError naming the field."""
    if not msg.HasField("lora_config"):
        return None
    lc = msg.lora_config
    try:
        return LoRAConfig(
            enable_lora=True,
            max_loras=lc.max_loras,
            max_lora_rank=lc.max_lora_rank,
            max_cpu_loras=lc.max_cpu_loras,
        )
    except ValueError as exc:
        raise ValueError(f"lora_config.{exc}") from None


# -- int32 arrays and ragged lists ------------------------------------------------------

# "I32" fields (see worker.proto): little-endian int32 bytes, converted in one
# C call each way (struct packs a list faster than array or numpy do).
_BIG_ENDIAN = sys.byteorder == "big"
if array("i").itemsize != 4:  # pragma: no cover - every platform we run on
    raise ImportError("tokenbudget.proto.convert needs a 4-byte C int")


def _i32(values: Collection[int]) -> bytes:
    if not values:
        return b""
    try:
        return struct.pack(f"<{len(values)}i", *values)
    except struct.error as exc:
        raise ValueError(f"cannot send {list(values)[:8]}... as int32: {exc}") from None


def _i32_list(data: bytes) -> list[int]:
    if not data:
        return []
    a = array("i")
    a.frombytes(data)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a.tolist()


_INDEX: list[int] = list(range(1024))


def _index(n: int) -> list[int]:
    """0, 1, ... (at least n of them), shared: cheaper than a fresh range's ints."""
    global _INDEX
    if len(_INDEX) < n:
        _INDEX = list(range(max(n, 2 * len(_INDEX))))
    return _INDEX


def _ragged_to_proto(lists: list[list[int]], out: worker_pb2.RaggedIds) -> None:
    n = len(lists)
    out.num_lists = n
    if n and len(lists[0]) == 1:
        try:
            singles = [x for (x,) in lists]  # decode steps: every request sampled one token
        except ValueError:
            pass
        else:
            out.flat = _i32(singles)
            return
    rows = list(compress(_index(n), lists))
    if not rows:  # decode steps between block boundaries: no request got a block
        out.sparse = True
        return
    if 2 * len(rows) <= n:  # mostly empty (decode steps: few requests get a new block)
        out.sparse = True
        out.rows = _i32(rows)
        lists = [lists[i] for i in rows]
    out.counts = _i32([len(x) for x in lists])
    out.flat = _i32(list(chain.from_iterable(lists)))


def _ragged_from_proto(msg: worker_pb2.RaggedIds, share_empty: bool = False) -> list[list[int]]:
    """``share_empty``: the empty lists of the sparse form are one shared list
    (read-only by contract): a decode step then allocates a list per request
    that got something, not per request."""
    n = msg.num_lists
    flat = _i32_list(msg.flat)
    if msg.sparse:
        lists = [[]] * n if share_empty else list(map(list, repeat((), n)))
        start = 0
        for row, count in zip(_i32_list(msg.rows), _i32_list(msg.counts)):
            lists[row] = flat[start : start + count]
            start += count
        return lists
    if not msg.counts:
        if len(flat) != n:
            raise ValueError(f"RaggedIds: {n} one-value lists but {len(flat)} values")
        return [[x] for x in flat]
    it = iter(flat)
    return [list(islice(it, count)) for count in _i32_list(msg.counts)]


def _pairs(data: bytes) -> list[tuple[int, int]]:
    """I32 values back to back -> (a, b) pairs (kv_swap_out / kv_swap_in)."""
    flat = _i32_list(data)
    if len(flat) % 2:
        raise ValueError(f"KV copy list of {len(flat)} values: expected pairs")
    return list(zip(flat[0::2], flat[1::2]))


# -- KV cache events -----------------------------------------------------------------------


def kv_event_batch_to_proto(batch: KVEventBatch) -> generate_pb2.KvEventBatch:
    msg = generate_pb2.KvEventBatch(
        seq=batch.seq, snapshot=batch.snapshot, num_dropped=batch.num_dropped
    )
    for e in batch.events:
        out = msg.events.add()
        if type(e) is BlockStored:
            out.stored.block_hash = e.block_hash
            out.stored.parent_hash = e.parent_hash or b""
            out.stored.token_ids = _i32(e.token_ids)
            out.stored.tier = e.tier
            out.stored.group = e.group
        elif type(e) is BlockRemoved:
            out.removed.block_hash = e.block_hash
            out.removed.tier = e.tier
            out.removed.group = e.group
        else:
            out.all_cleared.SetInParent()
    return msg


def kv_event_batch_from_proto(msg: generate_pb2.KvEventBatch) -> KVEventBatch:
    events = []
    for e in msg.events:
        kind = e.WhichOneof("kind")
        if kind == "stored":
            s, tokens = e.stored, _i32_list(e.stored.token_ids)
            events.append(BlockStored(s.block_hash, s.parent_hash or None, tokens, s.tier, s.group))
        elif kind == "removed":
            r = e.removed
            events.append(BlockRemoved(r.block_hash, r.tier, r.group))
        else:
            events.append(AllCleared())
    return KVEventBatch(msg.seq, events, msg.snapshot, msg.num_dropped)


# -- pooling params -----------------------------------------------------------------


def pooling_params_to_proto(params: PoolingParams, out: common_pb2.PoolingParams) -> None:
    out.SetInParent()  # present even when every field is the default
    if params.pooling_type is not None:
        out.pooling_type = params.pooling_type
    if params.normalize is not None:
        out.normalize = params.normalize


def pooling_params_from_proto(msg: common_pb2.PoolingParams) -> PoolingParams:
    """Raises ValueError naming a bad field."""
    return PoolingParams(
        msg.pooling_type if msg.HasField("pooling_type") else None,
        msg.normalize if msg.HasField("normalize") else None,
    )
