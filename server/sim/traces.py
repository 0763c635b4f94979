"""Workload traces: what arrives when, how long its prompt and output are, and
which prefixes it shares. No text, and nothing downloaded.

- ``poisson_arrivals``: a Poisson process, or a bursty gamma renewal process
  (``burstiness`` < 1: more clustered; 1: Poisson), like vLLM's benchmark.
- ``sharegpt_like``: lognormal prompt and output lengths, shaped like chat
  traffic (means near ShareGPT's: ~300 prompt, ~250 output tokens). A
  synthetic stand-in, not the data set.
- ``multi_turn_chat``: sessions whose turns resend the whole conversation
  (a shared system prompt, then earlier turns), so later turns hit the
  prefix cache.
- ``TraceRecorder`` / ``load_trace``: record a live workload (arrival time,
  prompt and output lengths, prefix block hashes) and replay it; identical
  recorded hashes become identical synthetic blocks, so the replay shares
  exactly what the recording shared.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.request import Request

TRACE_FORMAT = "tokenbudget-trace"


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    # A prefix shared with other requests: ``prefix_len`` tokens of prefix
    # ``prefix_id`` (a system prompt), or a session's history (multi-turn).
    prefix_id: int = -1
    prefix_len: int = 0
    session: int = -1
    # Replay: recorded hashes of the prompt's full blocks (hex).
    block_hashes: tuple[str, ...] = ()
    tenant: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def poisson_arrivals(n: int, rate: float, *, burstiness: float = 1.0, seed: int = 0,
                     start: float = 0.0) -> list[float]:
    """``n`` arrival times at ``rate`` per second; gaps are gamma distributed
    with shape ``burstiness`` (1: exponential, i.e. Poisson)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    rng = random.Random(seed)
    t = start
    out = []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so the mean (before clipping) is ``mean``
    return max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))


def sharegpt_like(n: int, rate: float, *, seed: int = 0, burstiness: float = 1.0,
                  prompt_mean: float = 300, output_mean: float = 250, sigma: float = 1.0,
                  max_prompt: int = 4096, max_output: int = 2048,
                  num_system_prompts: int = 0, system_prompt_len: int = 0,
                  tenant: str | None = None, ttft_ms: float | None = None,
                  tpot_ms: float | None = None) -> list[TraceRequest]:
    """Chat-like single-turn requests; optionally each starts with one of
    ``num_system_prompts`` shared prefixes of ``system_prompt_len`` tokens."""
    rng = random.Random(seed + 1)
    out = []
    for t in poisson_arrivals(n, rate, burstiness=burstiness, seed=seed):
        prompt = _lognormal(rng, prompt_mean, sigma, 4, max_prompt)
        prefix = rng.randrange(num_system_prompts) if num_system_prompts else -1
        plen = system_prompt_len if num_system_prompts else 0
        out.append(TraceRequest(t, prompt + plen, _lognormal(rng, output_mean, sigma, 1, max_output),
                                prefix_id=prefix, prefix_len=plen, tenant=tenant,
                                ttft_ms=ttft_ms, tpot_ms=tpot_ms))
    return out


def multi_turn_chat(num_sessions: int, session_rate: float, *, seed: int = 0,
                    mean_turns: float = 4, think_s: float = 10.0, system_prompt_len: int = 512,
                    num_system_prompts: int = 4, user_mean: float = 120,
                    output_mean: float = 200, max_context: int = 8000,
                    tenant: str | None = None, ttft_ms: float | None = None,
                    tpot_ms: float | None = None) -> list[TraceRequest]:
    """Sessions start as a Poisson process; each has a geometric number of
    turns, a think time (exponential) between them, and resends its history."""
    rng = random.Random(seed + 2)
    out = []
    starts = poisson_arrivals(num_sessions, session_rate, seed=seed)
    for s, t in enumerate(starts):
        system = rng.randrange(num_system_prompts)
        history = system_prompt_len
        turns = 1 + int(rng.expovariate(1.0 / max(mean_turns - 1, 1e-9))) if mean_turns > 1 else 1
        for _ in range(turns):
            user = _lognormal(rng, user_mean, 0.8, 4, 2048)
            output = _lognormal(rng, output_mean, 0.8, 1, 1024)
            if history + user + output > max_context:
                break
            out.append(TraceRequest(t, history + user, output, prefix_id=system,
                                    prefix_len=system_prompt_len, session=s, tenant=tenant,
                                    ttft_ms=ttft_ms, tpot_ms=tpot_ms))
            history += user + output
            t += rng.expovariate(1.0 / think_s) + 0.05 * output  # reading and thinking
    out.sort(key=lambda r: r.arrival_s)
    return out


def merge(*traces: Iterable[TraceRequest]) -> list[TraceRequest]:
    """One trace of several (tenants, say), in arrival order."""
    out = [r for t in traces for r in t]
    out.sort(key=lambda r: r.arrival_s)
    return out


def with_slo(trace: Iterable[TraceRequest], ttft_ms: float | None,
             tpot_ms: float | None) -> list[TraceRequest]:
    return [replace(r, ttft_ms=ttft_ms, tpot_ms=tpot_ms) for r in trace]


# -- record and replay ---------------------------------------------------------
class TraceRecorder:
    """Records requests as the engine sees them: arrival time, prompt length,
    the hashes of the prompt's full blocks (short hex; no token ids, no text),
    tenant and SLO targets, and the output length once finished.

    Call ``on_add(request)`` after the scheduler accepted it (its block hashes
    are computed then) and ``on_finish(request_id, num_output_tokens)``."""

    def __init__(self, block_size: int, hash_hex_chars: int = 16) -> None:
        self.block_size = block_size
        self.hex_chars = hash_hex_chars
        self.requests: dict[str, TraceRequest] = {}
        self._t0: float | None = None

    def on_add(self, request: Request) -> None:
        if self._t0 is None:
            self._t0 = request.arrival_time
        full = request.num_prompt_tokens // self.block_size
        hashes = tuple(h.hex()[:self.hex_chars] for h in request.block_hashes[:full])
        self.requests[request.request_id] = TraceRequest(
            request.arrival_time - self._t0, request.num_prompt_tokens, 0, block_hashes=hashes,
            tenant=request.tenant, ttft_ms=request.ttft_ms, tpot_ms=request.tpot_ms)

    def on_finish(self, request_id: str, num_output_tokens: int) -> None:
        rec = self.requests.get(request_id)
        if rec is not None:
            rec.output_len = num_output_tokens

    def save(self, path: str | Path) -> None:
        """JSON lines: a header, then one request per line, in arrival order."""
        recs = sorted(self.requests.values(), key=lambda r: r.arrival_s)
        with open(path, "w") as f:
            f.write(json.dumps({"format": TRACE_FORMAT, "version": 1,
                                "block_size": self.block_size}) + "\n")
            for r in recs:
                if r.output_len:  # finished requests only: an aborted one has no length
                    f.write(json.dumps(_compact(r)) + "\n")


def _compact(r: TraceRequest) -> dict:
    """The fields that differ from their defaults (and the three required ones)."""
    out = {}
    for f in fields(TraceRequest):
        v = getattr(r, f.name)
        if f.default is MISSING or v != f.default:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def load_trace(path: str | Path) -> tuple[list[TraceRequest], int]:
    """A recorded trace and the block size its hashes are over."""
    with open(path) as f:
        header = json.loads(f.readline())
        if header.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} file")
        out = []
        for line in f:
            d = json.loads(line)
            d["block_hashes"] = tuple(d.get("block_hashes", ()))
            out.append(TraceRequest(**d))
    return out, int(header["block_size"])
