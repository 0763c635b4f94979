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

A recorded trace (server/engine/trace.py: ``TraceRecorder``, ``load_trace``)
replays as these do.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import replace

from tokenbudget.server.engine.trace import TraceRequest


def poisson_arrivals(
    n: int, rate: float, *, burstiness: float = 1.0, seed: int = 0, start: float = 0.0
) -> list[float]:
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


def sharegpt_like(
    n: int,
    rate: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    prompt_mean: float = 300,
    output_mean: float = 250,
    sigma: float = 1.0,
    max_prompt: int = 4096,
    max_output: int = 2048,
    num_system_prompts: int = 0,
    system_prompt_len: int = 0,
    tenant: str | None = None,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
) -> list[TraceRequest]:
    """Chat-like single-turn requests; optionally each starts with one of
    ``num_system_prompts`` shared prefixes of ``system_prompt_len`` tokens."""
    rng = random.Random(seed + 1)
    out = []
    for t in poisson_arrivals(n, rate, burstiness=burstiness, seed=seed):
        prompt = _lognormal(rng, prompt_mean, sigma, 4, max_prompt)
        prefix = rng.randrange(num_system_prompts) if num_system_prompts else -1
        plen = system_prompt_len if num_system_prompts else 0
        out.append(
            TraceRequest(
                t,
                prompt + plen,
                _lognormal(rng, output_mean, sigma, 1, max_output),
                prefix_id=prefix,
                prefix_len=plen,
                tenant=tenant,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
            )
        )
    return out


def multi_turn_chat(
    num_sessions: int,
    session_rate: float,
    *,
    seed: int = 0,
    mean_turns: float = 4,
    think_s: float = 10.0,
    system_prompt_len: int = 512,
    num_system_prompts: int = 4,
    user_mean: float = 120,
    output_mean: float = 200,
    max_context: int = 8000,
    tenant: str | None = None,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
) -> list[TraceRequest]:
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
            out.append(
                TraceRequest(
                    t,
                    history + user,
                    output,
                    prefix_id=system,
                    prefix_len=system_prompt_len,
                    session=s,
                    tenant=tenant,
                    ttft_ms=ttft_ms,
                    tpot_ms=tpot_ms,
                )
            )
            history += user + output
            t += rng.expovariate(1.0 / think_s) + 0.05 * output  # reading and thinking
    out.sort(key=lambda r: r.arrival_s)
    return out


def merge(*traces: Iterable[TraceRequest]) -> list[TraceRequest]:
    """One trace of several (tenants, say), in arrival order."""
    out = [r for t in traces for r in t]
    out.sort(key=lambda r: r.arrival_s)
    return out


def with_slo(
    trace: Iterable[TraceRequest], ttft_ms: float | None, tpot_ms: float | None
) -> list[TraceRequest]:
    return [replace(r, ttft_ms=ttft_ms, tpot_ms=tpot_ms) for r in trace]
