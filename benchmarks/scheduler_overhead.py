#!/usr/bin/env python3
"""Scheduler overhead with a fake model (README.md, Benchmarks).

The fake model emits one token per request whose prefill is complete, so the
numbers are the scheduler's own cost: schedule() and update_from_output().
Prints one JSON line per (engine, workload).

    python benchmarks/scheduler_overhead.py                      # tokenbudget
    python benchmarks/scheduler_overhead.py --engine both \\
        --vllm-python /path/to/vllm-venv/bin/python                # side by side

``--engine vllm`` drives vLLM's V1 Scheduler the same way (run it with a
Python that has vllm installed; this script does not import tokenbudget then).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

BLOCK_SIZE = 16
BUDGET = 8192


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    max_num_seqs: int
    num_blocks: int
    # Steps measured: "decode" measures only steps where every request decodes.
    steady_decode_only: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}-{len(self.prompts)}"


def make_workloads(
    names: list[str],
    decode_sizes: list[int],
    seed: int = 0,
    prefixes: int = 8,
    prefill_seqs: int = 256,
    prefill_blocks: int | None = None,
) -> list[Workload]:
    rng = random.Random(seed)
    vocab = 32000

    def rand_tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    out = []
    if "decode" in names:
        for n in decode_sizes:
            prompts = [rand_tokens(512) for _ in range(n)]
            blocks = n * (512 + 256) // BLOCK_SIZE + n + 16
            out.append(Workload("decode", prompts, 256, n, blocks, steady_decode_only=True))
    if "prefill" in names:
        shared = [rand_tokens(768) for _ in range(prefixes)]
        prompts = [shared[i % prefixes] + rand_tokens(256) for i in range(2000)]
        rng.shuffle(prompts)
        # Default: room for all running requests and the shared prefixes.
        blocks = prefill_blocks or prefill_seqs * (1024 + 16) // BLOCK_SIZE + 512
        out.append(Workload("prefill", prompts, 16, prefill_seqs, blocks))
    if "pressure" in names:
        prompts = [rand_tokens(512) for _ in range(256)]
        blocks = 256 * (512 + 256) // BLOCK_SIZE // 4 + 1
        out.append(Workload("pressure", prompts, 256, 256, blocks))
    return out


# -- engines -------------------------------------------------------------------
class FakeModelDriver:
    """Shared by both engines: ``self.sched`` is a scheduler whose requests
    expose num_computed_tokens / num_tokens; ``make_output`` builds that
    engine's ModelRunnerOutput from request ids and sampled lists."""

    def schedule(self):
        return self.sched.schedule()

    def fake_model(self, so):
        reqs = self.sched.requests
        ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            r = reqs[rid]
            ids.append(rid)
            sampled.append([7] if r.num_computed_tokens >= r.num_tokens else [])
        return self.make_output(ids, {r: i for i, r in enumerate(ids)}, sampled)

    def all_decoding(self, so) -> bool:
        return not so.scheduled_new_reqs and len(
            so.num_scheduled_tokens
        ) == so.total_num_scheduled_tokens == len(self.sched.running)

    def done(self) -> bool:
        return not self.sched.has_unfinished_requests()


class TokenbudgetEngine(FakeModelDriver):
    name = "tokenbudget"

    def __init__(self, w: Workload, policy: str = "fcfs") -> None:
        from tokenbudget.core import (
            CacheConfig,
            ModelRunnerOutput,
            Request,
            SamplingParams,
            Scheduler,
            SchedulerConfig,
        )

        self.make_output = ModelRunnerOutput
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=BUDGET,
                max_num_seqs=w.max_num_seqs,
                max_model_len=2048,
                policy=policy,
            ),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=w.num_blocks, enable_prefix_caching=True),
        )
        params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
        for i, p in enumerate(w.prompts):
            self.sched.add_request(Request(str(i), p, params))

    def update(self, so, out):
        self.sched.update_from_output(so, out)

    def stats(self) -> dict:
        s = self.sched.make_stats()
        return {
            "prefix_hit_rate": round(s.prefix_cache_hit_rate, 4),
            "preemptions": s.num_preemptions,
        }


def run(engine_cls, w: Workload, **kw) -> dict:
    eng = engine_cls(w, **kw)
    sched_t, upd_t = [], []
    steps = 0
    perf = time.perf_counter
    while not eng.done():
        t0 = perf()
        so = eng.schedule()
        t1 = perf()
        out = eng.fake_model(so)
        t2 = perf()
        eng.update(so, out)
        t3 = perf()
        steps += 1
        if steps > 100000:
            raise RuntimeError(f"{w.label}: no progress")
        if not w.steady_decode_only or eng.all_decoding(so):
            sched_t.append(t1 - t0)
            upd_t.append(t3 - t2)
    total = [a + b for a, b in zip(sched_t, upd_t)]
    us = lambda xs: round(statistics.median(xs) * 1e6, 1) if xs else None  # noqa: E731
    return {
        "engine": eng.name,
        "workload": w.name,
        "num_requests": len(w.prompts),
        "steps": steps,
        "measured_steps": len(total),
        "schedule_us": us(sched_t),
        "update_us": us(upd_t),
        "total_us": us(total),
        **eng.stats(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", choices=["tokenbudget", "vllm", "both"], default="tokenbudget")
    ap.add_argument("--workloads", default="decode,prefill,pressure")
    ap.add_argument("--decode-sizes", default="64,256,1024")
    ap.add_argument("--policy", default="fcfs", help="tokenbudget waiting-queue policy")
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON", sys.executable),
        help="a Python with vllm installed, for --engine both",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per workload (median kept)")
    ap.add_argument("--prefixes", type=int, default=8, help="prefill: shared prefixes")
    ap.add_argument("--prefill-seqs", type=int, default=256, help="prefill: max_num_seqs")
    ap.add_argument(
        "--prefill-blocks",
        type=int,
        default=None,
        help="prefill: KV blocks (default: room for every running request)",
    )
    args = ap.parse_args()
    names = args.workloads.split(",")
    sizes = [int(x) for x in args.decode_sizes.split(",")]
    workloads = make_workloads(
        names,
        sizes,
        prefixes=args.prefixes,
        prefill_seqs=args.prefill_seqs,
        prefill_blocks=args.prefill_blocks,
    )
    for w in workloads:
        results = {}
        engines = ["tokenbudget", "vllm"] if args.engine == "both" else [args.engine]
        for e in engines:
            if e == "vllm" and args.engine == "both":
                results[e] = _run_vllm_subprocess(args, w)
            else:
                results[e] = _best_of(e, w, args)
            print(json.dumps(results[e]), flush=True)
        if len(results) == 2:
            ours, theirs = results["tokenbudget"], results["vllm"]
            print(
                json.dumps(
                    {
                        "ratio": "tokenbudget/vllm",
                        "workload": w.label,
                        "total_us_ratio": round(ours["total_us"] / theirs["total_us"], 3),
                    }
                ),
                flush=True,
            )


def _best_of(engine: str, w: Workload, args) -> dict:
    runs = []
    for _ in range(args.repeat):
        if engine == "vllm":
            from vllm_scheduler_driver import VllmEngine  # noqa: PLC0415

            runs.append(run(VllmEngine, w))
        else:
            runs.append(run(TokenbudgetEngine, w, policy=args.policy))
    return sorted(runs, key=lambda r: r["total_us"])[len(runs) // 2]


def _run_vllm_subprocess(args, w: Workload) -> dict:
    cmd = [
        args.vllm_python,
        os.path.abspath(__file__),
        "--engine",
        "vllm",
        "--workloads",
        w.name,
        "--decode-sizes",
        str(len(w.prompts)),
        "--repeat",
        str(args.repeat),
        "--prefixes",
        str(args.prefixes),
        "--prefill-seqs",
        str(args.prefill_seqs),
    ]
    if args.prefill_blocks:
        cmd += ["--prefill-blocks", str(args.prefill_blocks)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"vllm run failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
