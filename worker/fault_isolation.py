"""Find the requests that make a step fail, so that only they fail.

A step computes every scheduled request in one batch (one forward, one
sampler call), so one request's bad parameters (a logits processor that
raises on them, a top-k wider than the vocabulary, an image the vision tower
rejects) would fail everyone's step. ``run_isolating`` runs the step's
compute for all requests; if that raises, it bisects: each half is run
again, recursively, down to the single requests that still fail. With k
bad requests among n that is about 2·k·log2(n) extra runs, paid only on the
failure path. Re-running is safe because the compute commits nothing: KV
writes of a re-run are the same values at the same slots, and sampled
tokens are appended to the batch only afterwards (ModelRunner._commit);
the runner restores what a failed attempt advanced (seeded generators,
pooling sums).

A failure that every request of a step (two or more) shares is not
attributable to a request (a broken model, a device error): it is raised
as the step's error, as are the ``fatal`` exception types (out of memory).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenbudget.core.failures import RequestFailure, describe
from tokenbudget.core.outputs import ModelRunnerOutput


@dataclass(slots=True)
class StepPart:
    """What a run over some of the step's requests produced, not yet committed."""

    req_ids: list[str]
    sampled: list[list[int]]  # per request, in req_ids order
    logprobs: list[list[dict[int, float]] | None] | None
    prompt_logprobs: dict[str, Any] | None
    pooler_output: list[Any] | None = None  # per request, in req_ids order


def run_isolating(
    run: Callable[[list[str]], StepPart],
    req_ids: list[str],
    fatal: tuple[type[BaseException], ...] = (MemoryError,),
) -> tuple[list[StepPart], dict[str, RequestFailure]]:
    """``run(req_ids)`` over every request, else over the parts that succeed;
    returns the parts and the failure of each request that failed alone."""
    if not req_ids:
        return [], {}
    try:
        return [run(req_ids)], {}
    except fatal:
        raise
    except Exception as exc:
        first = exc
    if len(req_ids) == 1:
        return [], {req_ids[0]: describe(first)}
    parts: list[StepPart] = []
    failed: dict[str, RequestFailure] = {}
    mid = len(req_ids) // 2
    for half in (req_ids[:mid], req_ids[mid:]):
        _bisect(run, half, parts, failed, fatal)
    if len(failed) == len(req_ids):
        raise first  # every request fails: the step itself is broken
    return parts, failed


def _bisect(
    run: Callable[[list[str]], StepPart],
    req_ids: list[str],
    parts: list[StepPart],
    failed: dict[str, RequestFailure],
    fatal: tuple[type[BaseException], ...],
) -> None:
    try:
        parts.append(run(req_ids))
        return
    except fatal:
        raise
    except Exception as exc:
        if len(req_ids) == 1:
            failed[req_ids[0]] = describe(exc)
            return
    mid = len(req_ids) // 2
    for half in (req_ids[:mid], req_ids[mid:]):
        _bisect(run, half, parts, failed, fatal)


def merge_parts(
    req_ids: list[str], parts: list[StepPart], failed: dict[str, RequestFailure]
) -> ModelRunnerOutput:
    """The step's reply in scheduled order: each part's results at their
    requests' rows, empty rows for the failed ones."""
    index = {r: i for i, r in enumerate(req_ids)}
    if len(parts) == 1 and not failed:  # the usual case: one run did the whole step
        part = parts[0]
        return ModelRunnerOutput(
            req_ids,
            index,
            part.sampled,
            part.logprobs,
            pooler_output=part.pooler_output,
            prompt_logprobs=part.prompt_logprobs,
        )
    sampled: list[list[int]] = [[] for _ in req_ids]
    logprobs: list | None = None
    pooled: list | None = None
    prompt_logprobs: dict | None = None
    for part in parts:
        for k, rid in enumerate(part.req_ids):
            sampled[index[rid]] = part.sampled[k]
            if part.logprobs is not None and part.logprobs[k] is not None:
                if logprobs is None:
                    logprobs = [None] * len(req_ids)
                logprobs[index[rid]] = part.logprobs[k]
            if part.pooler_output is not None and part.pooler_output[k] is not None:
                if pooled is None:
                    pooled = [None] * len(req_ids)
                pooled[index[rid]] = part.pooler_output[k]
        if part.prompt_logprobs:
            prompt_logprobs = {**(prompt_logprobs or {}), **part.prompt_logprobs}
    return ModelRunnerOutput(
        req_ids,
        index,
        sampled,
        logprobs,
        pooler_output=pooled,
        prompt_logprobs=prompt_logprobs,
        failed=failed or None,
    )
