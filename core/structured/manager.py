"""Structured output with xgrammar: grammars compiled off the hot path, one
packed bitmask per step.

A request with ``SamplingParams.structured`` is handed to the manager on
arrival. Its grammar compiles off this thread (in a child process that is
killed at the timeout, or a thread: compile_process.py; cached by spec in
grammar_cache.py) while it waits in WAITING_FOR_FSM; the scheduler skips it,
keeping its queue position, until ``is_ready``. A compile that fails or
outlives ``compile_timeout_s`` comes back from ``take_failed`` and the
scheduler aborts the request with that error.

Each step ``grammar_bitmask`` fills one int32 row (xgrammar layout: bit j of
word w allows token 32*w + j) per sampled position of the scheduled
structured requests; the worker applies it to the logits before sampling.
``accept_tokens`` advances a request's matcher with the tokens it kept.

Parsing a spec and its cache key: grammar.py. xgrammar is imported only when
a request needs it, never at import time. Every method except ``validate``
and ``compile`` runs on the scheduler's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenbudget.core.failures import RequestFailure, describe
from tokenbudget.core.sampling_params import StructuredOutputParams
from tokenbudget.core.structured.compile_process import CompileTimeoutError, stoppable_compiles
from tokenbudget.core.structured.grammar import (
    GrammarError,
    cache_key,
    parse_grammar,
    xgrammar_message,
)
from tokenbudget.core.structured.grammar_cache import GrammarCache

if TYPE_CHECKING:
    from tokenbudget.core.request import Request

logger = logging.getLogger(__name__)


class GrammarTimeoutError(TimeoutError):
    """A grammar that did not compile within the manager's timeout."""


@dataclass(slots=True, eq=False)
class StructuredRequest:
    """The manager's per-request state (``Request.structured_request``)."""

    params: StructuredOutputParams
    compiled: Future
    deadline: float
    matcher: Any = None


# Compiled grammars kept for reuse, in bytes (grammar_cache.py: what they hold).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20


class StructuredOutputManager:
    """Compiles grammars and keeps one xgrammar matcher per structured request.

    ``vocab_size`` is the model's (logits) vocabulary, which may exceed the
    tokenizer's; the bitmask covers all of it (padding ids never allowed).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        compile_timeout_s: float = 30.0,
        cache_size: int = 128,
        cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
        compile_threads: int = 2,
        fill_threads: int | str = "auto",
        any_whitespace: bool = False,
        compile_in_process: bool = False,
    ) -> None:
        """``cache_size`` and ``cache_bytes`` bound the compiled grammars kept
        for reuse (least recently used go first); a grammar in use by a
        request lives as long as the request, cached or not.
        ``compile_in_process``: compile in child processes, killed at the
        timeout (compile_process.py; what servers do), not in threads."""
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be an integer >= 0, got {cache_bytes!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        # JSON without free whitespace: models cannot pad output with endless blanks.
        self.any_whitespace = any_whitespace
        self._compile_threads = compile_threads
        self._fill_threads = fill_threads
        self._compiler_lock = threading.Lock()
        # Spec keys that parsed (validate runs on server threads, hence the lock).
        self._valid_lock = threading.Lock()
        self._valid: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._compiler = self._info = None
        self._processes = stoppable_compiles(
            compile_in_process, self._tokenizer_info, any_whitespace
        )
        self._pool: ThreadPoolExecutor | None = None
        self._batch = None
        self._cache = GrammarCache(cache_size, cache_bytes)  # spec key -> Future
        # Waiting for their grammar / with a matcher, by request id.
        self._pending: dict[str, Request] = {}
        self._active: dict[str, Request] = {}
        # Requests whose matcher failed to fill their bitmask rows (those rows
        # allow everything); the scheduler fails them (take_fill_failures).
        self.fill_failures: dict[str, RequestFailure] = {}
        self.clock = time.monotonic

    @property
    def bitmask_words(self) -> int:
        return -(-self.vocab_size // 32)

    # -- compiling (any thread) -------------------------------------------------------
    def validate(self, params: StructuredOutputParams) -> None:
        """Parse the spec now (milliseconds, no tokenizer work) so a bad one is
        refused at submission with a GrammarError naming the problem."""
        key = cache_key(params)
        with self._valid_lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                return
        parse_grammar(params, any_whitespace=self.any_whitespace)
        with self._valid_lock:
            self._valid[key] = None
            while len(self._valid) > self.cache_size:
                self._valid.popitem(last=False)

    def compile(self, params: StructuredOutputParams):
        """Parse and compile a spec for this tokenizer (blocking, uncached)."""
        grammar = parse_grammar(params, any_whitespace=self.any_whitespace)
        try:
            return self._get_compiler().compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(f"structured.{params.kind}: {xgrammar_message(exc)}") from None

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._info = info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                # Our LRU is the cache: bounded, and a miss really compiles.
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self._compile_threads, cache_enabled=False
                )
            return self._compiler

    def _tokenizer_info(self):
        return self._get_compiler() and self._info

    def _compiled(self, params: StructuredOutputParams) -> Future:
        key = cache_key(params)
        fut = self._cache.get(key)
        if fut is not None:
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self._compile_threads, thread_name_prefix="tokenbudget-grammar"
            )
        deadline = time.monotonic() + self.compile_timeout_s
        fut = self._pool.submit(self._compile_until, params, deadline)
        self._cache.put(key, fut)
        return fut

    def _compile_until(self, params: StructuredOutputParams, deadline: float):
        """Compile in a child process ended at ``deadline``, or in this thread."""
        if self._processes is None:
            return self.compile(params)
        try:
            return self._processes.compile(params, deadline)
        except CompileTimeoutError:
            raise GrammarTimeoutError(
                f"structured.{params.kind}: the grammar did not compile within "
                f"{self.compile_timeout_s:g} s (its compile was stopped)"
            ) from None
        except (ValueError, EOFError) as exc:
            message = str(exc) or "the grammar compiler process ended"
            prefix = "" if message.startswith("structured.") else f"structured.{params.kind}: "
            raise GrammarError(prefix + message) from None

    @property
    def cached_bytes(self) -> int:
        """Memory of the compiled grammars in the cache (compiles in flight count 0)."""
        return self._cache.bytes

    def _evict(self) -> None:
        """Drop the least recently used grammars past the count or byte bound."""
        self._cache.evict()

    # -- request lifecycle (scheduler thread) --------------------------------------------
    def add_request(self, req: Request) -> None:
        params = req.sampling_params.structured
        req.structured_request = StructuredRequest(
            params, self._compiled(params), self.clock() + self.compile_timeout_s
        )
        self._pending[req.request_id] = req

    def is_ready(self, req: Request) -> bool:
        """Whether the grammar compiled; builds the request's matcher the first time."""
        sr = req.structured_request
        if sr.matcher is not None:
            return True
        fut = sr.compiled
        if not fut.done() or fut.exception() is not None:
            return False
        sr.matcher = self._make_matcher(req, fut.result())
        del self._pending[req.request_id]
        self._active[req.request_id] = req
        self._evict()  # its size is known now
        return True

    @staticmethod
    def _make_matcher(req: Request, compiled):
        import xgrammar as xgr

        params = req.sampling_params
        stops = [] if params.ignore_eos or req.eos_token_id is None else [req.eos_token_id]
        stops += [t for t in params.stop_token_ids if t not in stops]
        if not stops:
            # Nothing can stop it but the grammar's end.
            return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stops)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """Waiting requests whose compile failed or timed out, with the error."""
        if not self._pending:
            return []
        now = self.clock()
        failed: list[tuple[Request, Exception]] = []
        for req in self._pending.values():
            sr = req.structured_request
            if sr.compiled.done():
                exc = sr.compiled.exception()
                if exc is None:
                    continue
                # Let a corrected client retry the same spec.
                self._cache.drop(cache_key(sr.params), sr.compiled)
                if not isinstance(exc, (GrammarError, GrammarTimeoutError)):
                    exc = GrammarError(f"structured.{sr.params.kind}: {xgrammar_message(exc)}")
                failed.append((req, exc))
            elif now >= sr.deadline:
                failed.append(
                    (
                        req,
                        GrammarTimeoutError(
                            f"structured.{sr.params.kind}: the grammar did not compile within "
                            f"{self.compile_timeout_s:g} s"
                        ),
                    )
                )
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until some pending compile finishes
        (the engine calls this when it has nothing else to run)."""
        futures = [r.structured_request.compiled for r in self._pending.values()]
        futures = [f for f in futures if not f.done()]
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    def remove_request(self, req: Request) -> None:
        self._pending.pop(req.request_id, None)
        self._active.pop(req.request_id, None)
        sr, req.structured_request = req.structured_request, None
        fut = sr.compiled if sr is not None else None
        # A queued compile nobody waits for any more is never started (issue 26 4a).
        waiting = any(r.structured_request.compiled is fut for r in self._pending.values())
        if fut is not None and not waiting and fut.cancel():
            self._cache.drop(cache_key(sr.params), fut)

    # -- per step (scheduler thread) -----------------------------------------------------
    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        num_scheduled: dict[str, int],
        spec_tokens: dict[str, list[int]],
    ) -> tuple[np.ndarray | None, list[str]]:
        """Bitmask rows for the scheduled structured requests that sample this
        step: 1 + drafts rows each, in the order of the returned request ids.
        Row k of a request with drafts reflects its state after drafts[:k]."""
        ids = self.sampling_req_ids(num_scheduled, spec_tokens)
        return (self.fill_bitmask(ids, spec_tokens) if ids else None), ids

    def sampling_req_ids(
        self, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]
    ) -> list[str]:
        """The scheduled structured requests that sample this step, in
        scheduled order: when every scheduled row is constrained the worker
        masks its logits in place, without reordering rows."""
        active = self._active
        ids: list[str] = []
        if not active:
            return ids
        for rid, n in num_scheduled.items():
            req = active.get(rid)
            if req is None:
                continue
            drafts = spec_tokens.get(rid) if spec_tokens else None
            num_drafts = len(drafts) if drafts else 0
            if (
                req.num_computed_tokens + n
                < req.num_tokens + req.num_output_placeholders + num_drafts
            ):
                continue  # a prefill chunk that does not sample
            ids.append(rid)
        return ids

    def fill_bitmask(self, req_ids: list[str], spec_tokens: dict[str, list[int]]) -> np.ndarray:
        """The rows of ``req_ids`` (see grammar_bitmask) from the matchers'
        current state. A request removed since it was scheduled (a deferred
        fill after it finished) gets rows that allow everything: its sample
        is discarded, and a row without any allowed token could break sampling."""
        matchers: list = []
        rows: list[int] = []
        drafted: list[tuple[Any, list[int], int]] = []
        free: list[tuple[int, int]] = []
        k = 0
        for rid in req_ids:
            drafts = spec_tokens.get(rid) if spec_tokens else None
            num_drafts = len(drafts) if drafts else 0
            req = self._active.get(rid)
            if req is None:
                free.append((k, k + 1 + num_drafts))
            elif num_drafts:
                drafted.append((req.structured_request.matcher, drafts, k))
            else:
                matchers.append(req.structured_request.matcher)
                rows.append(k)
            k += 1 + num_drafts
        bitmask = np.empty((k, self.bitmask_words), dtype=np.int32)
        for lo, hi in free:
            bitmask[lo:hi] = -1
        for matcher, drafts, first_row in drafted:
            try:
                _fill_with_drafts(matcher, drafts, bitmask, first_row)
            except Exception as exc:  # this request's matcher broke: it alone fails
                self._fill_failed(matcher, exc, bitmask, first_row, first_row + len(drafts) + 1)
        if matchers:
            try:
                self._batch_matcher().batch_fill_next_token_bitmask(
                    matchers, bitmask, rows if len(rows) < k else None
                )
            except Exception:
                # Find the matchers that fail and fill the others one by one.
                for matcher, row in zip(matchers, rows):
                    try:
                        matcher.fill_next_token_bitmask(bitmask, row)
                    except Exception as exc:
                        self._fill_failed(matcher, exc, bitmask, row, row + 1)
        return bitmask

    def _fill_failed(self, matcher, exc: Exception, bitmask: np.ndarray, lo: int, hi: int) -> None:
        bitmask[lo:hi] = -1  # its sample is discarded; an all-zero row could break sampling
        rid = next(
            r for r, req in self._active.items() if req.structured_request.matcher is matcher
        )
        logger.error("request %s: its grammar matcher failed: %s", rid, exc)
        self.fill_failures[rid] = describe(exc)

    def take_fill_failures(self) -> dict[str, RequestFailure]:
        failures, self.fill_failures = self.fill_failures, {}
        return failures

    def _batch_matcher(self):
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(self._fill_threads)
        return self._batch

    def accept_tokens(self, req: Request, token_ids: list[int]) -> bool:
        """Advance the matcher; True when it reached its end (the request stops).

        Raises RuntimeError on a token the grammar rejects: only a worker that
        did not apply the bitmask samples one, and the request must fail (the
        scheduler fails it alone, without outputting the token) rather than
        end as a normal stop with text outside its grammar."""
        matcher = req.structured_request.matcher
        for t in token_ids:
            if matcher.is_terminated():
                return True  # past the grammar's end (ends without a stop token)
            if not matcher.accept_token(t):
                logger.error(
                    "request %s: token %d violates its grammar; failing it", req.request_id, t
                )
                raise RuntimeError(
                    f"the worker sampled token {t}, which the request's grammar does not "
                    "allow (it did not apply the grammar bitmask); no output past it"
                )
        return matcher.is_terminated()

    def validate_drafts(self, req: Request, draft_token_ids: list[int]) -> list[int]:
        """The longest prefix of the drafts the grammar allows (the first
        invalid draft and everything after it are dropped)."""
        matcher = req.structured_request.matcher
        n = 0
        for t in draft_token_ids:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return draft_token_ids[:n]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.shutdown()


def _fill_with_drafts(matcher, drafts: list[int], bitmask: np.ndarray, first_row: int) -> None:
    """Rows first_row .. first_row + len(drafts): the mask before each draft and
    after the last. Past an invalid draft the rows allow everything: its own
    row forbids it, so the worker rejects it and all that follows."""
    accepted = 0
    for j in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(bitmask, first_row + j)
        if j == len(drafts):
            break
        if matcher.is_terminated() or not matcher.accept_token(drafts[j]):
            bitmask[first_row + j + 1 : first_row + len(drafts) + 1] = -1
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
