"""The ModelRunnerOutput half of the ExecuteModel step stream (see
proto/step_stream.py): the worker's reply to each step, back to the engine.

Rows in the step's order are sent without their request ids, and a decoder
keeps the last step's ids, so messages must be decoded in order, one decoder
per stream. Importable from proto/step_stream.py as before.
"""

from __future__ import annotations

from tokenbudget.core.failures import RequestFailure
from tokenbudget.core.outputs import ModelRunnerOutput, PromptLogprobs
from tokenbudget.proto import worker_pb2
from tokenbudget.proto.kv_connector import kv_sending_from_proto, kv_sending_to_proto
from tokenbudget.proto.convert import (
    _ragged_from_proto,
    _ragged_to_proto,
    value_from_proto,
    value_to_proto,
)


def model_runner_output_to_proto(
    out: ModelRunnerOutput, step_id: int = 0, scheduled_req_ids: list[str] | None = None
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
    kv_sending_to_proto(out, msg)
    return msg


class ModelRunnerOutputDecoder:
    """Engine side: protobuf -> ModelRunnerOutput. Steady decode steps repeat
    the last step's rows, so they get the last step's req_id_to_index dict
    again (read-only, like the whole output), not a new one."""

    def __init__(self) -> None:
        self._last_req_ids: list[str] = []
        self._last_index: dict[str, int] = {}

    def decode(
        self, msg: worker_pb2.ModelRunnerOutput, scheduled_req_ids: list[str] | None = None
    ) -> ModelRunnerOutput:
        """``scheduled_req_ids`` must be what the sender was given (see
        model_runner_output_to_proto); the output's req_ids is that list."""
        req_ids = list(msg.req_ids)
        if not req_ids and msg.sampled_token_ids.num_lists:
            if scheduled_req_ids is None:
                raise ValueError(
                    "this ModelRunnerOutput omits its req_ids: pass the step's scheduled_req_ids"
                )
            req_ids = scheduled_req_ids
        if req_ids != self._last_req_ids:
            self._last_req_ids = list(req_ids)  # the caller's list may change later
            self._last_index = dict(zip(req_ids, range(len(req_ids))))
        finished_sending, failed_sending = kv_sending_from_proto(msg)
        logprobs = None
        if msg.has_logprobs:
            logprobs = [
                [dict(zip(t.token_ids, t.logprobs)) for t in rl.tokens] if rl.present else None
                for rl in msg.logprobs
            ]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=self._last_index,
            sampled_token_ids=_ragged_from_proto(msg.sampled_token_ids),
            logprobs=logprobs,
            pooler_output=(
                [value_from_proto(v) for v in msg.pooler_output] if msg.has_pooler_output else None
            ),
            spec_token_ids=(
                _ragged_from_proto(msg.spec_token_ids) if msg.has_spec_token_ids else None
            ),
            prompt_logprobs={
                p.req_id: PromptLogprobs(
                    p.start, [dict(zip(t.token_ids, t.logprobs)) for t in p.entries]
                )
                for p in msg.prompt_logprobs
            }
            or None,
            failed={
                rid: RequestFailure(f.message, f.invalid_argument) for rid, f in msg.failed.items()
            }
            or None,
            finished_sending=finished_sending,
            failed_sending=failed_sending,
        )
