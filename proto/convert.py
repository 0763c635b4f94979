"""The one place where engine dataclasses become protobuf and back.

Tensors (multimodal pixel values, grammar bitmasks) travel as raw bytes plus
dtype and shape; torch is imported only when a tensor is actually met, so the
scheduler side (core) stays torch-free.
"""
from __future__ import annotations

import json
import struct
import sys
from array import array
from itertools import chain, compress, islice, repeat
from numbers import Integral, Real
from operator import itemgetter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.failures import RequestFailure
from tokenbudget.core.spec_config import SpeculativeConfig
from tokenbudget.core.outputs import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                      PromptLogprobs, SchedulerOutput)
from tokenbudget.core.pooling_params import PoolingParams
from tokenbudget.core.request import MultiModalFeature
from tokenbudget.core.sampling_params import (STRUCTURED_KINDS, SamplingParams,
                                              StructuredOutputParams)
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

_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k",
                             "min_p", "seed", "ignore_eos", "logprobs",
                             "include_stop_str_in_output", "repetition_penalty",
                             "frequency_penalty", "presence_penalty", "n", "prompt_logprobs",
                             "skip_special_tokens", "spaces_between_special_tokens",
                             "truncate_prompt_tokens")
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


def sampling_params_from_proto(msg: common_pb2.SamplingParams,
                               defaults: Mapping[str, Any] | None = None) -> SamplingParams:
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

_CACHE_FIELDS = ("block_size", "enable_prefix_caching", "gpu_memory_utilization", "hash_algo",
                 "kv_load_blocks_per_step", "enable_kv_cache_events")
_CACHE_OPTIONAL = ("num_blocks", "kv_cache_memory_bytes", "kv_offload_memory_bytes",
                   "num_offload_blocks")
_SCHED_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                 "long_prefill_token_threshold", "policy", "encoder_compute_budget",
                 "encoder_cache_size", "async_scheduling")
_SPEC_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def configs_to_proto(cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                     out: worker_pb2.InitializeRequest) -> None:
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
    cc = msg.cache_config
    cache = CacheConfig(**{n: getattr(cc, n) for n in _CACHE_FIELDS},
                        **{n: getattr(cc, n) if cc.HasField(n) else None for n in _CACHE_OPTIONAL})
    sc = msg.scheduler_config
    spec = None
    if sc.HasField("speculative_config"):
        spec = SpeculativeConfig(**{n: getattr(sc.speculative_config, n) for n in _SPEC_FIELDS})
    sched = SchedulerConfig(**{n: getattr(sc, n) for n in _SCHED_FIELDS}, speculative_config=spec)
    return cache, sched


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


def _pick(table, keys: list) -> Sequence:
    """[table[k] for k in keys], at C speed (a tuple when more than one)."""
    if len(keys) > 1:
        return itemgetter(*keys)(table)
    return [table[k] for k in keys]


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


def _ragged_from_proto(msg: worker_pb2.RaggedIds, share_empty: bool = False,
                       ) -> list[list[int]]:
    """``share_empty``: the empty lists of the sparse form are one shared list
    (read-only by contract): a decode step then allocates a list per request
    that got something, not per request."""
    n = msg.num_lists
    flat = _i32_list(msg.flat)
    if msg.sparse:
        lists = [[]] * n if share_empty else list(map(list, repeat((), n)))
        start = 0
        for row, count in zip(_i32_list(msg.rows), _i32_list(msg.counts)):
            lists[row] = flat[start:start + count]
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
    msg = generate_pb2.KvEventBatch(seq=batch.seq, snapshot=batch.snapshot,
                                    num_dropped=batch.num_dropped)
    for e in batch.events:
        out = msg.events.add()
        if type(e) is BlockStored:
            out.stored.block_hash = e.block_hash
            out.stored.parent_hash = e.parent_hash or b""
            out.stored.token_ids = _i32(e.token_ids)
            out.stored.tier = e.tier
        elif type(e) is BlockRemoved:
            out.removed.block_hash = e.block_hash
            out.removed.tier = e.tier
        else:
            out.all_cleared.SetInParent()
    return msg


def kv_event_batch_from_proto(msg: generate_pb2.KvEventBatch) -> KVEventBatch:
    events = []
    for e in msg.events:
        kind = e.WhichOneof("kind")
        if kind == "stored":
            s = e.stored
            events.append(BlockStored(s.block_hash, s.parent_hash or None,
                                      _i32_list(s.token_ids), s.tier))
        elif kind == "removed":
            events.append(BlockRemoved(e.removed.block_hash, e.removed.tier))
        else:
            events.append(AllCleared())
    return KVEventBatch(msg.seq, events, msg.snapshot, msg.num_dropped)


# -- SchedulerOutput (stateful: request handles) ----------------------------------------


class SchedulerOutputEncoder:
    """Engine side of the ExecuteModel stream: SchedulerOutput -> protobuf.

    Gives each request a small int handle the first time it is sent (see
    worker.proto) and names it by that handle afterwards. One encoder feeds
    every worker of an executor; each worker stream has its own decoder, and
    messages must reach it in the order they were encoded.
    """

    def __init__(self) -> None:
        self._handles: dict[str, int] = {}
        self._free: list[int] = []  # retired handles, reused from the next step on
        self._next = 0
        # Steady decode steps repeat the last step's cached requests: reuse their handles.
        self._last_cached_ids: list[str] | None = None
        self._last_cached_handles = b""
        self._last_counts: list[int] = []
        self._last_counts_bytes = b""
        # The last step's scheduled order: a step repeating it and its counts
        # is sent as such (repeats_last_step in worker.proto).
        self._last_order: list[str] | None = None

    def encode(self, so: SchedulerOutput, step_id: int = 0) -> worker_pb2.SchedulerOutput:
        msg = self._encode_repeat(so, step_id)
        if msg is not None:
            return msg
        msg = self._encode_full(so, step_id)
        nst = so.num_scheduled_tokens
        self._last_order = list(nst) if nst else None
        return msg

    def _encode_repeat(self, so: SchedulerOutput, step_id: int,
                       ) -> worker_pb2.SchedulerOutput | None:
        """The message of a steady step (see repeats_last_step), or None when
        ``so`` is not one: the hot path."""
        cached = so.scheduled_cached_reqs
        nst = so.num_scheduled_tokens
        if (so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids
                or so.scheduled_spec_decode_tokens or so.scheduled_encoder_inputs
                or so.free_encoder_mm_hashes or so.grammar_bitmask is not None
                or so.structured_req_ids or cached.resumed_token_ids or not nst
                or so.kv_swap_out or so.kv_swap_in
                or cached.req_ids != self._last_order or list(nst) != cached.req_ids
                or list(nst.values()) != self._last_counts):
            return None
        msg = worker_pb2.SchedulerOutput(
            step_id=step_id, total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            num_common_prefix_blocks=so.num_common_prefix_blocks, repeats_last_step=True)
        # Fields are set in place: nested constructor arguments would be copied.
        out = msg.scheduled_cached_reqs
        out.num_computed_tokens = _i32(cached.num_computed_tokens)
        lists = cached.new_block_ids
        if any(lists):
            _ragged_to_proto(lists, out.new_block_ids)
        else:  # decode steps between block boundaries
            blocks = out.new_block_ids
            blocks.num_lists = len(lists)
            blocks.sparse = True
        return msg

    def _encode_full(self, so: SchedulerOutput, step_id: int) -> worker_pb2.SchedulerOutput:
        msg = worker_pb2.SchedulerOutput(
            step_id=step_id, total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            num_common_prefix_blocks=so.num_common_prefix_blocks)
        # Every field below is skipped when empty: decode steps send few.
        finished = self._retire(so.finished_req_ids, msg) if so.finished_req_ids else ()
        if so.preempted_req_ids:
            handles = self._handles
            msg.preempted_handles = _i32([handles[r] for r in so.preempted_req_ids
                                          if r in handles])
            msg.preempted_unsent_req_ids.extend(r for r in so.preempted_req_ids
                                                if r not in handles)
        if so.free_encoder_mm_hashes:
            msg.free_encoder_mm_hashes.extend(so.free_encoder_mm_hashes)
        new_ids = []
        for r in so.scheduled_new_reqs:
            _new_request_to_proto(r, self._assign(r.req_id), msg.scheduled_new_reqs.add())
            new_ids.append(r.req_id)
        cached = so.scheduled_cached_reqs
        if cached.req_ids:
            out = msg.scheduled_cached_reqs
            if cached.req_ids != self._last_cached_ids:
                self._last_cached_ids = list(cached.req_ids)
                self._last_cached_handles = _i32(self._lookup(cached.req_ids))
            out.handles = self._last_cached_handles
            _ragged_to_proto(cached.new_block_ids, out.new_block_ids)
            out.num_computed_tokens = _i32(cached.num_computed_tokens)
            self._id_lists_to_proto(cached.resumed_token_ids, out.resumed_token_ids)
        nst = so.num_scheduled_tokens
        if nst:
            if list(nst) != (cached.req_ids + new_ids if new_ids else cached.req_ids):
                msg.scheduled_handles = _i32(self._lookup(list(nst)))
            counts = list(nst.values())
            if counts != self._last_counts:  # decode steps: all ones, step after step
                self._last_counts, self._last_counts_bytes = counts, _i32(counts)
            msg.num_scheduled_tokens = self._last_counts_bytes
        self._id_lists_to_proto(so.scheduled_spec_decode_tokens, msg.scheduled_spec_decode_tokens)
        self._id_lists_to_proto(so.scheduled_encoder_inputs, msg.scheduled_encoder_inputs)
        if so.grammar_bitmask is not None:
            tensor_to_proto(so.grammar_bitmask, msg.grammar_bitmask)
        if so.structured_req_ids:
            msg.structured_handles = _i32(self._lookup(so.structured_req_ids))
        if so.kv_swap_out:
            msg.kv_swap_out = _i32(list(chain.from_iterable(so.kv_swap_out)))
        if so.kv_swap_in:
            msg.kv_swap_in = _i32(list(chain.from_iterable(so.kv_swap_in)))
        self._free.extend(finished)  # reusable from the next step on
        return msg

    def _retire(self, req_ids: set[str], msg: worker_pb2.SchedulerOutput) -> list[int]:
        """Take the finished requests' handles away before new requests get
        theirs, so a new request reusing a finished id in the same step gets a
        fresh handle. Ids never sent have no handle and go by name."""
        finished = []
        for r in req_ids:
            h = self._handles.pop(r, None)
            if h is None:
                msg.finished_unsent_req_ids.append(r)
            else:
                finished.append(h)
        if finished:
            msg.finished_handles = _i32(finished)
            self._last_cached_ids = None  # a retired handle may come back for another id
        return finished

    def _assign(self, req_id: str) -> int:
        handle = self._handles.get(req_id)
        if handle is None:
            if self._free:
                handle = self._free.pop()
            else:
                handle, self._next = self._next, self._next + 1
            self._handles[req_id] = handle
        return handle

    def _lookup(self, req_ids: list[str]) -> Sequence[int]:
        try:
            return _pick(self._handles, req_ids)
        except KeyError as exc:
            raise ValueError(f"request {exc.args[0]!r} has no handle: it was never sent to "
                             "the worker as a new request, or it finished") from None

    def _id_lists_to_proto(self, d: dict[str, list[int]], out) -> None:
        for key, ids in d.items():
            out[self._lookup([key])[0]].ids.extend(ids)


class SchedulerOutputDecoder:
    """Worker side of one ExecuteModel stream: protobuf -> SchedulerOutput.
    Keeps handle -> request id for the requests the stream has announced.

    The output is read-only: rows of ``new_block_ids`` without new blocks
    share one empty list (a steady decode step would otherwise allocate one
    list per running request, and the garbage collector's passes with them),
    and a step repeating the last one's requests and counts gets the same
    ``req_ids`` list and ``num_scheduled_tokens`` dict as that step.
    """

    def __init__(self) -> None:
        self._ids: list[str | None] = []
        # Steady decode steps repeat the last step's requests and counts: they
        # get the last step's list and dict again. Keyed by the wire bytes.
        self._last_handles = b""
        self._last_req_ids: list[str] = []
        self._last_nst_key: tuple[bytes, ...] | None = None
        self._last_nst: dict[str, int] = {}
        # The last step's scheduled order (list(self._last_nst)), for a step
        # that repeats it; None until a step was decoded.
        self._last_order: list[str] | None = None

    def decode(self, msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
        if msg.repeats_last_step:
            return self._decode_repeat(msg)
        so = self._decode_full(msg)
        nst = so.num_scheduled_tokens
        if not nst:
            self._last_order = None
        elif so.scheduled_new_reqs or list(nst) != so.scheduled_cached_reqs.req_ids:
            self._last_order = list(nst)
        else:  # the cached requests' list: a repeat then shares it
            self._last_order = so.scheduled_cached_reqs.req_ids
        return so

    def _decode_repeat(self, msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
        order = self._last_order
        if order is None:
            raise ValueError("a step repeats the last step's requests, but the stream has "
                             "no last step with requests")
        c = msg.scheduled_cached_reqs
        return SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=order,
                new_block_ids=_ragged_from_proto(c.new_block_ids, share_empty=True),
                num_computed_tokens=_i32_list(c.num_computed_tokens)),
            num_scheduled_tokens=self._last_nst,
            total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
            num_common_prefix_blocks=msg.num_common_prefix_blocks)

    def _decode_full(self, msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
        # Fields are tested before they are converted: decode steps send few.
        finished_handles = _i32_list(msg.finished_handles) if msg.finished_handles else []
        finished = set(self._names(finished_handles))
        if msg.finished_unsent_req_ids:
            finished.update(msg.finished_unsent_req_ids)
        preempted = set()
        if msg.preempted_handles or msg.preempted_unsent_req_ids:
            preempted.update(self._names(_i32_list(msg.preempted_handles)))
            preempted.update(msg.preempted_unsent_req_ids)
        if msg.scheduled_new_reqs or finished_handles:
            self._last_handles, self._last_nst_key = b"", None  # handles change hands
        new_reqs = [self._new_request_from_proto(m) for m in msg.scheduled_new_reqs]
        c = msg.scheduled_cached_reqs
        handles = c.handles
        if handles and handles == self._last_handles:
            req_ids = self._last_req_ids
        else:
            req_ids = self._names(_i32_list(handles))
            self._last_handles, self._last_req_ids = handles, req_ids
        cached = CachedRequestData(
            req_ids=req_ids,
            new_block_ids=_ragged_from_proto(c.new_block_ids, share_empty=True),
            num_computed_tokens=_i32_list(c.num_computed_tokens),
            resumed_token_ids=self._id_lists_from_proto(c.resumed_token_ids),
        )
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self._num_scheduled_tokens(msg, cached.req_ids, new_reqs),
            total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=self._id_lists_from_proto(
                msg.scheduled_spec_decode_tokens),
            scheduled_encoder_inputs=self._id_lists_from_proto(msg.scheduled_encoder_inputs),
            num_common_prefix_blocks=msg.num_common_prefix_blocks,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            free_encoder_mm_hashes=(list(msg.free_encoder_mm_hashes)
                                    if msg.free_encoder_mm_hashes else []),
            grammar_bitmask=(tensor_from_proto(msg.grammar_bitmask)
                             if msg.HasField("grammar_bitmask") else None),
            structured_req_ids=(self._names(_i32_list(msg.structured_handles))
                                if msg.structured_handles else []),
            kv_swap_out=_pairs(msg.kv_swap_out) if msg.kv_swap_out else [],
            kv_swap_in=_pairs(msg.kv_swap_in) if msg.kv_swap_in else [],
        )
        for h in finished_handles:
            self._ids[h] = None
        return so

    def _num_scheduled_tokens(self, msg: worker_pb2.SchedulerOutput, cached_ids: list[str],
                              new_reqs: list[NewRequestData]) -> dict[str, int]:
        key = (msg.scheduled_cached_reqs.handles, msg.scheduled_handles,
               msg.num_scheduled_tokens)
        if not new_reqs and key == self._last_nst_key:
            return self._last_nst
        order = (self._names(_i32_list(msg.scheduled_handles)) if msg.scheduled_handles
                 else cached_ids + [r.req_id for r in new_reqs])
        nst = dict(zip(order, _i32_list(msg.num_scheduled_tokens)))
        self._last_nst_key, self._last_nst = (None if new_reqs else key), nst
        return nst

    def _names(self, handles: list[int]) -> list[str]:
        try:
            return list(_pick(self._ids, handles))
        except IndexError:
            raise ValueError(f"a step names request handles {handles} the stream never "
                             "announced") from None

    def _id_lists_from_proto(self, m) -> dict[str, list[int]]:
        if not m:
            return {}
        return {self._names([h])[0]: list(v.ids) for h, v in m.items()}

    def _new_request_from_proto(self, m: worker_pb2.NewRequest) -> NewRequestData:
        ids = self._ids
        if m.handle >= len(ids):
            ids.extend([None] * (m.handle + 1 - len(ids)))
        ids[m.handle] = m.req_id
        features = [MultiModalFeature(f.mm_hash, f.offset, f.length, value_from_proto(f.data))
                    for f in m.mm_features]
        return NewRequestData(
            req_id=m.req_id, prompt_token_ids=_i32_list(m.prompt_token_ids),
            mm_features=features, sampling_params=sampling_params_from_proto(m.sampling_params),
            block_ids=_i32_list(m.block_ids), num_computed_tokens=m.num_computed_tokens,
            lora_id=m.lora_id if m.HasField("lora_id") else None,
            eos_token_id=m.eos_token_id if m.HasField("eos_token_id") else None,
            pooling_params=(pooling_params_from_proto(m.pooling_params)
                            if m.HasField("pooling_params") else None))


def _new_request_to_proto(r: NewRequestData, handle: int, out: worker_pb2.NewRequest) -> None:
    out.req_id = r.req_id
    out.handle = handle
    out.prompt_token_ids = _i32(r.prompt_token_ids)
    for f in r.mm_features:
        fm = out.mm_features.add(mm_hash=f.mm_hash, offset=f.offset, length=f.length)
        value_to_proto(f.data, fm.data)
    sampling_params_to_proto(r.sampling_params, out.sampling_params)
    out.block_ids = _i32(r.block_ids)
    out.num_computed_tokens = r.num_computed_tokens
    if r.lora_id is not None:
        out.lora_id = r.lora_id
    if r.eos_token_id is not None:
        out.eos_token_id = r.eos_token_id
    if r.pooling_params is not None:
        pooling_params_to_proto(r.pooling_params, out.pooling_params)


def pooling_params_to_proto(params: PoolingParams, out: common_pb2.PoolingParams) -> None:
    out.SetInParent()  # present even when every field is the default
    if params.pooling_type is not None:
        out.pooling_type = params.pooling_type
    if params.normalize is not None:
        out.normalize = params.normalize


def pooling_params_from_proto(msg: common_pb2.PoolingParams) -> PoolingParams:
    """Raises ValueError naming a bad field."""
    return PoolingParams(msg.pooling_type if msg.HasField("pooling_type") else None,
                         msg.normalize if msg.HasField("normalize") else None)


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
    for rid, plp in (out.prompt_logprobs or {}).items():
        entry = msg.prompt_logprobs.add(req_id=rid, start=plp.start)
        for per_token in plp.entries:
            entry.entries.add(token_ids=per_token.keys(), logprobs=per_token.values())
    for rid, failure in (out.failed or {}).items():
        msg.failed[rid].message = failure.message
        msg.failed[rid].invalid_argument = failure.invalid_argument
    return msg


class ModelRunnerOutputDecoder:
    """Engine side: protobuf -> ModelRunnerOutput. Steady decode steps repeat
    the last step's rows, so they get the last step's req_id_to_index dict
    again (read-only, like the whole output), not a new one."""

    def __init__(self) -> None:
        self._last_req_ids: list[str] = []
        self._last_index: dict[str, int] = {}

    def decode(self, msg: worker_pb2.ModelRunnerOutput,
               scheduled_req_ids: list[str] | None = None) -> ModelRunnerOutput:
        """``scheduled_req_ids`` must be what the sender was given (see
        model_runner_output_to_proto); the output's req_ids is that list."""
        req_ids = list(msg.req_ids)
        if not req_ids and msg.sampled_token_ids.num_lists:
            if scheduled_req_ids is None:
                raise ValueError("this ModelRunnerOutput omits its req_ids: pass the step's "
                                 "scheduled_req_ids")
            req_ids = scheduled_req_ids
        if req_ids != self._last_req_ids:
            self._last_req_ids = list(req_ids)  # the caller's list may change later
            self._last_index = dict(zip(req_ids, range(len(req_ids))))
        logprobs = None
        if msg.has_logprobs:
            logprobs = [[dict(zip(t.token_ids, t.logprobs)) for t in rl.tokens] if rl.present
                        else None for rl in msg.logprobs]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=self._last_index,
            sampled_token_ids=_ragged_from_proto(msg.sampled_token_ids),
            logprobs=logprobs,
            pooler_output=([value_from_proto(v) for v in msg.pooler_output]
                           if msg.has_pooler_output else None),
            spec_token_ids=(_ragged_from_proto(msg.spec_token_ids)
                            if msg.has_spec_token_ids else None),
            prompt_logprobs={
                p.req_id: PromptLogprobs(p.start, [dict(zip(t.token_ids, t.logprobs))
                                                   for t in p.entries])
                for p in msg.prompt_logprobs} or None,
            failed={rid: RequestFailure(f.message, f.invalid_argument)
                    for rid, f in msg.failed.items()} or None,
        )
