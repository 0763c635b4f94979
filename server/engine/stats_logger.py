"""Log lines an operator reads (``server --log-stats-interval``, ``--log-level debug``).

Every ``interval`` seconds while the engine works (and once more if the last
line still showed requests running or waiting), one line like vLLM's::

    Avg generation throughput: 812.4 tokens/s, Running: 64 reqs, Waiting: 12 reqs,
    KV cache usage: 41.2%, Prefix cache hit rate: 63.0%, Finished: 130 reqs, Preemptions: 0

(throughput, finished requests and preemptions over the interval; the others
as last observed; the hit rate since start; with speculative decoding, the draft
acceptance rate and mean accepted length since start are appended). At debug level (at info with
``log_requests``, vLLM's ``--enable-log-requests``), one line per finished
request. The engine thread only records numbers (EngineMetrics
forwards its hooks here); a daemon thread writes the periodic line, so an
idle engine still gets its last line out.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tokenbudget.server.engine.client_strings import loggable

logger = logging.getLogger("tokenbudget.server.stats")


class StatsLogger:
    """``interval`` seconds between periodic lines; 0 writes none (the
    per-request debug lines stay). Call ``close()`` to stop the thread."""

    def __init__(self, interval: float, *, start: bool = True, log_requests: bool = False) -> None:
        if interval < 0:
            raise ValueError(f"log interval must be >= 0 seconds, got {interval}")
        self.interval = interval
        self.request_level = logging.INFO if log_requests else logging.DEBUG
        # Written by the engine thread only; the logging thread just reads them.
        self._num_tokens = 0
        self._num_finished = 0
        self._stats: Any | None = None
        # The logging thread's own state: the counts at its last line.
        self._last_time = time.monotonic()
        self._last_tokens = 0
        self._last_finished = 0
        self._last_preemptions = 0
        self._showed_busy = False  # the last line had requests running or waiting
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval > 0 and start:
            self._thread = threading.Thread(
                target=self._run, name="tokenbudget-stats-logger", daemon=True
            )
            self._thread.start()

    # -- engine thread -----------------------------------------------------------------
    def record_tokens(self, n: int) -> None:
        self._num_tokens += n

    def record_engine(self, stats: Any) -> None:
        """``stats``: the engine's EngineStats (running, waiting, KV usage, ...)."""
        self._stats = stats

    def record_finished(
        self,
        timing: Any,
        now: float,
        *,
        request_id: str | None = None,
        num_prompt_tokens: int | None = None,
        finish_reason: str | None = None,
    ) -> None:
        """A request finished; ``timing`` has ``arrival``, ``first_token`` (or
        None) and ``num_tokens`` on the engine's monotonic clock."""
        self._num_finished += 1
        if not logger.isEnabledFor(self.request_level):
            return
        parts = [f"request {loggable(request_id)}" if request_id else "request", "finished"]
        if finish_reason:
            parts.append(f"({finish_reason})")
        detail = []
        if num_prompt_tokens is not None:
            detail.append(f"prompt {num_prompt_tokens} tokens")
        detail.append(f"output {timing.num_tokens} tokens")
        if timing.first_token is not None:
            detail.append(f"TTFT {(timing.first_token - timing.arrival) * 1e3:.1f} ms")
            if timing.num_tokens > 1:
                tpot = (now - timing.first_token) / (timing.num_tokens - 1)
                detail.append(f"TPOT {tpot * 1e3:.1f} ms")
        detail.append(f"e2e {now - timing.arrival:.3f} s")
        logger.log(self.request_level, "%s: %s", " ".join(parts), ", ".join(detail))

    # -- logging thread ----------------------------------------------------------------
    def log(self, now: float | None = None) -> str | None:
        """Write the line for the time since the last one, unless nothing
        happened and the last line showed the engine idle; returns it."""
        now = time.monotonic() if now is None else now
        stats = self._stats
        tokens, finished = self._num_tokens, self._num_finished
        preemptions = stats.num_preemptions if stats is not None else 0
        elapsed = max(now - self._last_time, 1e-9)
        d_tokens, d_finished = tokens - self._last_tokens, finished - self._last_finished
        d_preemptions = preemptions - self._last_preemptions
        running = stats.num_running if stats is not None else 0
        waiting = stats.num_waiting if stats is not None else 0
        self._last_time, self._last_tokens, self._last_finished = now, tokens, finished
        self._last_preemptions = preemptions
        # Quiet while idle, but the line after a busy one shows the engine drained.
        if not (d_tokens or d_finished or running or waiting or self._showed_busy):
            return None
        self._showed_busy = bool(running or waiting)
        kv = stats.kv_cache_usage if stats is not None else 0.0
        queries = stats.prefix_cache_queries if stats is not None else 0
        hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
        line = (
            f"Avg generation throughput: {d_tokens / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {kv * 100:.1f}%, Prefix cache hit rate: {hit_rate * 100:.1f}%, "
            f"Finished: {d_finished} reqs, Preemptions: {d_preemptions}"
        )
        if stats is not None and getattr(stats, "spec_num_drafts", 0):
            # Speculative decoding, since start (like the hit rate).
            rate = stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1)
            line += (
                f", Draft acceptance rate: {rate * 100:.1f}%, "
                f"Mean accepted length: {stats.spec_mean_accepted_length:.2f}"
            )
        logger.info("%s", line)
        return line

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.log()
