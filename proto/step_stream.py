"""The ExecuteModel step stream: SchedulerOutput to the worker and
ModelRunnerOutput back, one message per step.

Unlike the stateless codecs of proto/convert.py, both directions keep state
across messages: requests are named by small int handles after their first
step, and a steady decode step repeating the last one's requests and counts
is sent as such (repeats_last_step in worker.proto). So messages must be
decoded in the order they were encoded, one decoder per stream.

This module holds the SchedulerOutput codec; the ModelRunnerOutput one is
in proto/runner_output.py (re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter

from tokenbudget.core.lora import LoRARequest
from tokenbudget.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenbudget.core.request import MultiModalFeature
from tokenbudget.proto import worker_pb2
from tokenbudget.proto.kv_connector import (
    kv_connector_metadata_from_proto,
    kv_connector_metadata_to_proto,
)
from tokenbudget.proto.convert import (
    _i32,
    _i32_list,
    _pairs,
    _ragged_from_proto,
    _ragged_to_proto,
    pooling_params_from_proto,
    pooling_params_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    tensor_from_proto,
    tensor_to_proto,
    value_from_proto,
    value_to_proto,
)

# The ModelRunnerOutput codec lives in proto/runner_output.py; importable from here as before.
from tokenbudget.proto.runner_output import ModelRunnerOutputDecoder, model_runner_output_to_proto

__all__ = [
    "ModelRunnerOutputDecoder",
    "SchedulerOutputDecoder",
    "SchedulerOutputEncoder",
    "model_runner_output_to_proto",
]


def _pick(table, keys: list) -> Sequence:
    """[table[k] for k in keys], at C speed (a tuple when more than one)."""
    if len(keys) > 1:
        return itemgetter(*keys)(table)
    return [table[k] for k in keys]


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
        if msg is None:
            msg = self._encode_full(so, step_id)
            nst = so.num_scheduled_tokens
            self._last_order = list(nst) if nst else None
        if so.kv_connector_metadata is not None:  # steady steps too
            kv_connector_metadata_to_proto(so.kv_connector_metadata, msg.kv_connector_metadata)
        return msg

    def _encode_repeat(
        self, so: SchedulerOutput, step_id: int
    ) -> worker_pb2.SchedulerOutput | None:
        """The message of a steady step (see repeats_last_step), or None when
        ``so`` is not one: the hot path."""
        cached = so.scheduled_cached_reqs
        nst = so.num_scheduled_tokens
        if (
            so.scheduled_new_reqs
            or so.finished_req_ids
            or so.preempted_req_ids
            or so.scheduled_spec_decode_tokens
            or so.scheduled_encoder_inputs
            or so.free_encoder_mm_hashes
            or so.grammar_bitmask is not None
            or so.structured_req_ids
            or cached.resumed_token_ids
            or not nst
            or so.kv_swap_out
            or so.kv_swap_in
            or cached.req_ids != self._last_order
            or list(nst) != cached.req_ids
            or list(nst.values()) != self._last_counts
        ):
            return None
        msg = worker_pb2.SchedulerOutput(
            step_id=step_id,
            total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            num_common_prefix_blocks=so.num_common_prefix_blocks,
            repeats_last_step=True,
        )
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
            step_id=step_id,
            total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            num_common_prefix_blocks=so.num_common_prefix_blocks,
        )
        # Every field below is skipped when empty: decode steps send few.
        finished = self._retire(so.finished_req_ids, msg) if so.finished_req_ids else ()
        if so.preempted_req_ids:
            handles = self._handles
            msg.preempted_handles = _i32([handles[r] for r in so.preempted_req_ids if r in handles])
            msg.preempted_unsent_req_ids.extend(r for r in so.preempted_req_ids if r not in handles)
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
            raise ValueError(
                f"request {exc.args[0]!r} has no handle: it was never sent to "
                "the worker as a new request, or it finished"
            ) from None

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
            so = self._decode_repeat(msg)
            so.kv_connector_metadata = kv_connector_metadata_from_proto(msg)
            return so
        so = self._decode_full(msg)
        so.kv_connector_metadata = kv_connector_metadata_from_proto(msg)
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
            raise ValueError(
                "a step repeats the last step's requests, but the stream has "
                "no last step with requests"
            )
        c = msg.scheduled_cached_reqs
        return SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=order,
                new_block_ids=_ragged_from_proto(c.new_block_ids, share_empty=True),
                num_computed_tokens=_i32_list(c.num_computed_tokens),
            ),
            num_scheduled_tokens=self._last_nst,
            total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
            num_common_prefix_blocks=msg.num_common_prefix_blocks,
        )

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
                msg.scheduled_spec_decode_tokens
            ),
            scheduled_encoder_inputs=self._id_lists_from_proto(msg.scheduled_encoder_inputs),
            num_common_prefix_blocks=msg.num_common_prefix_blocks,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            free_encoder_mm_hashes=(
                list(msg.free_encoder_mm_hashes) if msg.free_encoder_mm_hashes else []
            ),
            grammar_bitmask=(
                tensor_from_proto(msg.grammar_bitmask) if msg.HasField("grammar_bitmask") else None
            ),
            structured_req_ids=(
                self._names(_i32_list(msg.structured_handles)) if msg.structured_handles else []
            ),
            kv_swap_out=_pairs(msg.kv_swap_out) if msg.kv_swap_out else [],
            kv_swap_in=_pairs(msg.kv_swap_in) if msg.kv_swap_in else [],
        )
        for h in finished_handles:
            self._ids[h] = None
        return so

    def _num_scheduled_tokens(
        self, msg: worker_pb2.SchedulerOutput, cached_ids: list[str], new_reqs: list[NewRequestData]
    ) -> dict[str, int]:
        key = (msg.scheduled_cached_reqs.handles, msg.scheduled_handles, msg.num_scheduled_tokens)
        if not new_reqs and key == self._last_nst_key:
            return self._last_nst
        order = (
            self._names(_i32_list(msg.scheduled_handles))
            if msg.scheduled_handles
            else cached_ids + [r.req_id for r in new_reqs]
        )
        nst = dict(zip(order, _i32_list(msg.num_scheduled_tokens)))
        self._last_nst_key, self._last_nst = (None if new_reqs else key), nst
        return nst

    def _names(self, handles: list[int]) -> list[str]:
        try:
            return list(_pick(self._ids, handles))
        except IndexError:
            raise ValueError(
                f"a step names request handles {handles} the stream never announced"
            ) from None

    def _id_lists_from_proto(self, m) -> dict[str, list[int]]:
        if not m:
            return {}
        return {self._names([h])[0]: list(v.ids) for h, v in m.items()}

    def _new_request_from_proto(self, m: worker_pb2.NewRequest) -> NewRequestData:
        ids = self._ids
        if m.handle >= len(ids):
            ids.extend([None] * (m.handle + 1 - len(ids)))
        ids[m.handle] = m.req_id
        features = [
            MultiModalFeature(f.mm_hash, f.offset, f.length, value_from_proto(f.data))
            for f in m.mm_features
        ]
        return NewRequestData(
            req_id=m.req_id,
            prompt_token_ids=_i32_list(m.prompt_token_ids),
            mm_features=features,
            sampling_params=sampling_params_from_proto(m.sampling_params),
            block_ids=_i32_list(m.block_ids),
            num_computed_tokens=m.num_computed_tokens,
            lora_id=m.lora_id if m.HasField("lora_id") else None,
            lora_request=(
                LoRARequest(m.lora_name, m.lora_id, m.lora_path)
                if m.HasField("lora_name")
                else None
            ),
            eos_token_id=m.eos_token_id if m.HasField("eos_token_id") else None,
            pooling_params=(
                pooling_params_from_proto(m.pooling_params)
                if m.HasField("pooling_params")
                else None
            ),
            output_token_ids=_i32_list(m.output_token_ids) if m.output_token_ids else [],
        )


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
    if r.lora_request is not None:
        out.lora_name, out.lora_path = r.lora_request.lora_name, r.lora_request.lora_path
    if r.eos_token_id is not None:
        out.eos_token_id = r.eos_token_id
    if r.pooling_params is not None:
        pooling_params_to_proto(r.pooling_params, out.pooling_params)
    if r.output_token_ids:
        out.output_token_ids = _i32(r.output_token_ids)
