"""Failures contained to one request, and the checks of a worker's reply.

A fault caused by one request (its sampling parameters in the sampler or a
logits processor, its grammar matcher, its image) must end that request
alone: the worker attributes it (worker/fault_isolation.py) and reports a
``RequestFailure`` per request id in ``ModelRunnerOutput.failed``; the
scheduler finishes those requests with status FINISHED_ERROR (finish reason
"error") and the step's other requests proceed. A reply that cannot be
attributed (the worker died, the forward failed for every request) stays a
step error, as does a reply that is malformed (``WorkerReplyError``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Paths of source files in a message, with a line number if any ("/x/y/z.py",
# "/project/cpp/matcher.cc:489", "C:\\x\\y.py"): clients must not learn the
# server's file layout.
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-]+)+\.[A-Za-z]\w*(?::\d+)?")


@dataclass(slots=True)
class RequestFailure:
    """Why a request failed in a step. ``invalid_argument``: the failure came
    from the request's own parameters (a ValueError), not from the engine."""

    message: str
    invalid_argument: bool = False


class RequestFailedError(RuntimeError):
    """A request failed inside the engine; the others went on (gRPC INTERNAL)."""


class UnsupportedRequestError(RuntimeError):
    """The engine's workers cannot serve this kind of request, e.g. a pooling
    request on a worker that only samples (gRPC UNIMPLEMENTED: retrying, or
    sending it elsewhere in the same deployment, cannot help)."""


class InvalidRequestError(ValueError):
    """A request's parameters made it fail inside the engine (gRPC INVALID_ARGUMENT)."""


class WorkerReplyError(RuntimeError):
    """A worker's reply does not answer the step it was sent (a step error)."""


class DuplicateRequestError(ValueError):
    """A request id that is already in the scheduler."""


class QueueFullError(ValueError):
    """The waiting queue is at max_queued_requests."""


def describe(exc: BaseException) -> RequestFailure:
    """The failure a client may see: the exception's class and message,
    without source paths or a traceback."""
    text = _PATH.sub("<source>", str(exc)).strip().splitlines()
    message = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return RequestFailure(message, isinstance(exc, ValueError))


def error_of(failure: RequestFailure) -> Exception:
    """The exception a request's reader raises for ``failure``."""
    if failure.invalid_argument:
        return InvalidRequestError(f"the request failed: {failure.message}")
    return RequestFailedError(f"the request failed in the engine: {failure.message}")
