"""Stop-string matching cost per streamed token with 1, 16 and 1,024 stop
strings (issue 26: at most 2x the 1-string cost at 1,024 strings).

A sample (SampleState over the tiny model's tokenizer, one RequestOutput per
token) streams natural text; its stop strings never match but share their
first characters and words with the text, so every token is searched and
checked for hold-back. Prints one JSON line: microseconds per token (the
fastest of ``--repeat`` runs) with no
stop strings (``none_us``: detokenizing alone) and with N of them
(``total_us[N]``), the matching share (``matching_us[N]`` = total - none),
the ratios at 1,024 strings, and for reference what the old per-string scan
(every string searched on every token) costs on the same text
(``per_string_scan_us[N]``).

    python benchmarks/stop_strings.py [--tokens 20000 --repeat 5]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

WORDS = ["the", "scheduler", "token", "budget", "café", "KV", "cache", "block", "42", "—"]


def _token_stream(tokenizer, n: int) -> list[int]:
    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(200)))
    return ids[:n]


def _stop_strings(n: int) -> list[str]:
    """Strings that begin like the text (a word, a space) and then never match it."""
    rng = random.Random(n)
    out = []
    while len(out) < n:
        s = f"{rng.choice(WORDS)} {rng.choice(WORDS)}{rng.randrange(10**6)}#"
        if s not in out:
            out.append(s)
    return out


def _per_token_us(runs: dict, ids: list[int], repeat: int) -> dict:
    """Microseconds per token of each run, the fastest of ``repeat`` rounds;
    the runs take turns within a round, so a busy spell on this shared box
    slows them alike rather than one."""
    best = {name: float("inf") for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(ids)
            best[name] = min(best[name], (time.perf_counter() - t0) / len(ids) * 1e6)
    return {name: round(us, 3) for name, us in best.items()}


def _per_string_scan(stop: list[str], text_pieces: list[str]) -> None:
    """The old matcher: every string searched, and checked for hold-back, per token."""
    recent, keep = "", max(len(s) for s in stop) - 1
    for piece in text_pieces:
        recent = recent[-keep:] + piece
        for s in stop:
            recent.find(s, max(0, len(recent) - len(piece) - len(s) + 1))
        for s in stop:
            for k in range(min(len(s) - 1, len(recent)), 0, -1):
                if recent.endswith(s[:k]):
                    break


def measure(num_tokens: int, repeat: int, counts: tuple[int, ...]) -> dict:
    from tokenbudget.core import RequestOutput, SamplingParams
    from tokenbudget.server.engine.detokenizer import IncrementalDetokenizer
    from tokenbudget.server.engine.output_processor import SampleState
    from tokenbudget.server.testing.tiny_models import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(tmp)
    ids = _token_stream(tokenizer, num_tokens)
    pieces = [tokenizer.decode([t]) for t in ids]

    def sample(stop):
        def run(ids):
            params = SamplingParams(max_tokens=10**6, stop=stop)
            state = SampleState(0, params, IncrementalDetokenizer(tokenizer))
            for t in ids:
                state.update([RequestOutput("r", [t])])
                assert not state.finished

        return run

    stops = {n: _stop_strings(n) for n in counts}
    runs = {"none": sample(None), **{n: sample(stop) for n, stop in stops.items()}}
    us = _per_token_us(runs, ids, repeat)
    none = us.pop("none")
    result = {"tokens": len(ids), "none_us": none, "total_us": us}
    result["matching_us"] = {n: round(t - none, 3) for n, t in us.items()}
    scans = {n: (lambda _ids, s=stop: _per_string_scan(s, pieces)) for n, stop in stops.items()}
    result["per_string_scan_us"] = _per_token_us(scans, ids, 1)
    lo, hi = min(counts), max(counts)
    result[f"total_ratio_{hi}_vs_{lo}"] = round(result["total_us"][hi] / result["total_us"][lo], 2)
    result[f"matching_ratio_{hi}_vs_{lo}"] = round(
        result["matching_us"][hi] / max(result["matching_us"][lo], 1e-3), 2
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--counts", default="1,16,1024", help="stop-string counts, comma-separated")
    args = p.parse_args()
    counts = tuple(int(c) for c in args.counts.split(","))
    print(json.dumps(measure(args.tokens, args.repeat, counts)), flush=True)


if __name__ == "__main__":
    main()
