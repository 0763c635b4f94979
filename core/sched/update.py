"""Reading a model step's reply: Scheduler.update_from_output, and the rules
about one request it applies (stops, drafts, pooled vectors, prompt
logprobs, a missing token)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenbudget.core.failures import UnsupportedRequestError, WorkerReplyError, describe
from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.request import RequestStatus
from tokenbudget.core.stop import check_stop

if TYPE_CHECKING:
    from tokenbudget.core.config import SchedulerConfig
    from tokenbudget.core.outputs import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
    from tokenbudget.core.request import Request
    from tokenbudget.core.sched.encoder_budget import EncoderBudget
    from tokenbudget.core.sched.stats import SpecDecodingStats


def pooled_result(
    req: Request, vector: Any, new: list[int] | None
) -> tuple[RequestStatus, RequestOutput] | None:
    """How a pooling request ends this step, with its output; None while its
    prompt is not fully pooled. Prefill only: it finishes in the step that
    pooled its whole prompt."""
    rid = req.request_id
    if vector is not None:
        return RequestStatus.FINISHED_STOPPED, RequestOutput(
            rid, [], "stop", None, req.num_cached_tokens, pooling_output=vector
        )
    if not new:
        return None
    # A worker that knows no pooling sampled instead: fail, not hang.
    req.stop_reason = "the worker does not support pooling requests"
    return RequestStatus.FINISHED_ABORTED, RequestOutput(
        rid,
        [],
        "abort",
        None,
        req.num_cached_tokens,
        req.stop_reason,
        UnsupportedRequestError(
            f"request {rid}: {req.stop_reason} (it returned a token, "
            "not a vector); upgrade the worker"
        ),
    )


def check_no_token_due(req: Request, must_sample: set[str]) -> None:
    """A reply without a token for ``req`` is fine mid-prefill; raises
    WorkerReplyError when ``req`` had to sample this step."""
    if (
        req.request_id in must_sample
        or req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders
    ):
        raise WorkerReplyError(
            f"the worker's reply has no token for request {req.request_id!r}, which had to "
            "sample this step; failing the step rather than leave it waiting"
        )


def new_prompt_logprobs(req: Request, computed: PromptLogprobs) -> list | None:
    """The entries not output before (a preempted request recomputes its prompt)."""
    skip = req.num_prompt_logprobs_sent - computed.start
    # Chunks are computed in order from position 0 (no prefix hits): no gap.
    assert skip >= 0, (
        f"{req.request_id}: prompt logprobs from {computed.start}, "
        f"expected {req.num_prompt_logprobs_sent}"
    )
    entries = computed.entries[skip:]
    if not entries:
        return None
    req.num_prompt_logprobs_sent += len(entries)
    return entries


def fit_drafts(req: Request, draft: list[int], max_len: int, som) -> list[int]:
    """The drafts ``req`` can verify next: within ``max_len`` tokens (past
    what the whole cache holds they would only preempt it) and its
    max_tokens, and those its grammar accepts."""
    room = min(max_len - req.num_tokens, req.max_tokens - req.num_output_tokens) - 1
    draft = draft[: max(room, 0)]
    if draft and req.structured_request is not None:
        draft = som.validate_drafts(req, draft)
    return draft


class UpdateFromOutput:
    """update_from_output, a base of Scheduler (core/sched/scheduler.py).
    The Scheduler owns the state read here (annotated below); the ways a
    request ends (_free_request, _fail_requests, take_side_outputs) are
    RequestLifecycle's (core/sched/lifecycle.py)."""

    scheduler_config: SchedulerConfig
    requests: dict[str, Request]
    running: list[Request]
    waiting: Any
    structured_output_manager: Any
    encoder_budget: EncoderBudget
    spec_decoding_stats: SpecDecodingStats
    num_stale_drafts: int
    _pool_tokens: int

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        self._report_sends(model_runner_output)
        outputs = self._fail_reported(model_runner_output)
        som = self.structured_output_manager
        requests = self.requests
        self.num_stale_drafts = 0
        mro = model_runner_output
        index_of, sampled, logprobs = mro.req_id_to_index, mro.sampled_token_ids, mro.logprobs
        prompt_logprobs, drafts = mro.prompt_logprobs, mro.spec_token_ids
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        max_model_len = self.scheduler_config.max_model_len
        finished_running = False
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None:
                continue  # finished or aborted since it was scheduled
            i = index_of.get(rid)
            new = sampled[i] if i is not None and i < len(sampled) else None
            if req.mm_features:
                self.encoder_budget.free_computed(req)
            if req.pooling_params is not None:
                finished_running |= self._update_pooling(req, i, new, model_runner_output, outputs)
                continue
            if not new:
                self._update_without_token(req, scheduler_output, prompt_logprobs, outputs)
                continue
            plp = None
            if prompt_logprobs is not None and rid in prompt_logprobs:
                plp = new_prompt_logprobs(req, prompt_logprobs[rid])
            if spec_scheduled and spec_scheduled.get(rid):
                self._count_drafts(req, len(spec_scheduled[rid]), len(new))
            if req.num_output_placeholders:
                req.num_output_placeholders = max(0, req.num_output_placeholders - len(new))
            status, kept = check_stop(req, new, max_model_len)
            if som is not None and req.structured_request is not None:
                status = self._accept_structured(req, kept, status)
                if rid not in requests:  # its matcher broke or refused a token: it alone failed
                    outputs += self.take_side_outputs()
                    continue
            lp = None
            if logprobs is not None and logprobs[i] is not None:
                lp = logprobs[i][: len(kept)]
            reason = None
            if status is not None:
                reason = RequestStatus.finish_reason(status)
                finished_running |= self._finish_in_step(req, status)
            elif drafts is not None and drafts[i]:
                self._take_drafts(req, drafts[i])
            # Positional: a keyword makes the dataclass's __init__ a third slower.
            outputs.append(
                RequestOutput(
                    rid, kept, reason, lp, req.num_cached_tokens, req.stop_reason, None, plp
                )
            )
        if finished_running:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def _update_without_token(
        self,
        req: Request,
        scheduler_output: SchedulerOutput,
        prompt_logprobs: dict[str, PromptLogprobs] | None,
        outputs: list[RequestOutput],
    ) -> None:
        """A reply with no token for ``req``: fine mid-prefill, where its new
        prompt logprobs (if any) are output; else WorkerReplyError."""
        rid = req.request_id
        plp = None
        if prompt_logprobs is not None and rid in prompt_logprobs:
            plp = new_prompt_logprobs(req, prompt_logprobs[rid])
        check_no_token_due(req, scheduler_output.must_sample)
        if plp:  # mid-prefill
            outputs.append(
                RequestOutput(rid, [], None, None, req.num_cached_tokens, prompt_logprobs=plp)
            )

    def _count_drafts(self, req: Request, num_drafts: int, num_new: int) -> None:
        """A verification step's reply: ``num_new`` tokens for ``num_drafts``
        drafts. Rejected drafts were computed but are not part of the sequence."""
        req.num_computed_tokens -= num_drafts + 1 - num_new
        self.spec_decoding_stats.observe(num_drafts, num_new - 1)

    def _fail_reported(self, model_runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Fail the requests the reply reports failed, and those whose grammar
        bitmask could not be filled; returns every output that arose outside
        a model step since the last update."""
        if model_runner_output.failed:
            self._fail_requests(model_runner_output.failed)
        som = self.structured_output_manager
        if som is not None and som.fill_failures:
            self._fail_requests(som.take_fill_failures())
        return self.take_side_outputs()

    def _finish_in_step(self, req: Request, status: RequestStatus) -> bool:
        """Free a request that finished in the step; True if it was running."""
        running = req.status == RequestStatus.RUNNING
        if not running:  # async: preempted while its last token was in flight
            self.waiting.remove_requests([req])
        self._free_request(req, status)
        return running

    def _update_pooling(
        self,
        req: Request,
        i: int | None,
        new: list[int] | None,
        model_runner_output: ModelRunnerOutput,
        outputs: list[RequestOutput],
    ) -> bool:
        """A pooling request's reply; True if it finished running."""
        pooled = model_runner_output.pooler_output
        vector = pooled[i] if pooled is not None and i is not None else None
        result = pooled_result(req, vector, new)
        if result is None:
            return False
        req.num_output_placeholders = 0
        outputs.append(result[1])
        return self._finish_in_step(req, result[0])

    def _accept_structured(
        self, req: Request, kept: list[int], status: RequestStatus | None
    ) -> RequestStatus | None:
        """Advance ``req``'s grammar matcher by ``kept``; the grammar may end
        it. A matcher that breaks, or a token the grammar rejects (a worker
        that did not apply the bitmask), fails the request alone; the caller
        outputs none of ``kept``."""
        try:
            if self.structured_output_manager.accept_tokens(req, kept) and status is None:
                req.stop_reason = "grammar"
                return RequestStatus.FINISHED_STOPPED
        except Exception as exc:
            # check_stop appended ``kept``; none of it is output, so none of it
            # stays in the request (its final output equals what it streamed).
            if kept:
                del req.output_token_ids[-len(kept) :], req.all_token_ids[-len(kept) :]
            self._fail_requests({req.request_id: describe(exc)})
        return status

    def _take_drafts(self, req: Request, draft: list[int]) -> None:
        if req.num_output_placeholders:
            # Async: a step already in flight extends the sequence these drafts
            # were proposed for; the engine drains so that the next proposals
            # are fresh (EngineCore._step_async).
            self.num_stale_drafts += 1
            return
        cfg = self.scheduler_config
        max_len = min(cfg.max_model_len, self._pool_tokens - cfg.num_speculative_tokens)
        req.spec_token_ids = fit_drafts(req, draft, max_len, self.structured_output_manager)
