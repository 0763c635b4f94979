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


@dataclass(slots=True)
class StepPart:
    """What a run over some of the step's requests produced, not yet committed."""

    req_ids: list[str]
    sampled: list[list[int]]                      # per request, in req_ids order
    logprobs: list[list[dict[int, float]] | None] | None
    prompt_logprobs: dict[str, Any] | None
    pooler_output: list[Any] | None = None        # per request, in req_ids order


def run_isolating(run: Callable[[list[str]], StepPart], req_ids: list[str],
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


def _bisect(run: Callable[[list[str]], StepPart], req_ids: list[str], parts: list[StepPart],
            failed: dict[str, RequestFailure], fatal: tuple[type[BaseException], ...]) -> None:
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
