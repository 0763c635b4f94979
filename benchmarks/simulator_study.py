#!/usr/bin/env python3
"""Capacity-planning study with the simulator (server/sim): policies x
traces x replicas for Qwen3-8B on an H100-shaped profile, in simulated time.
Prints one JSON line per run and, with --markdown PATH, writes the table.

    python benchmarks/simulator_study.py --markdown benchmarks/simulator_results.md

The H100 figures are roofline extrapolations (datasheet peaks x assumed
efficiencies, plus the host overhead fitted on a CPU recording), not
measurements on an H100.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenbudget.server.sim import (
    GPU_DEFAULT_CONSTANTS,
    TraceRequest,
    get_hardware,
    get_model,
    merge,
    multi_turn_chat,
    poisson_arrivals,
    sharegpt_like,
    simulate,
)
from tokenbudget.server.sim.calibrate import fit_recorded

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {
    "fcfs": {},
    "lpm": {"policy": "lpm"},
    "slo": {"policy": "slo"},
    "slo+reject": {"policy": "slo", "slo_reject_late": True},
}


def traces(n: int, rate: float, ttft_ms: float, tpot_ms: float):
    return {
        "sharegpt": sharegpt_like(n, rate, seed=0, ttft_ms=ttft_ms, tpot_ms=tpot_ms),
        "bursty": sharegpt_like(n, rate, seed=0, burstiness=0.25, ttft_ms=ttft_ms, tpot_ms=tpot_ms),
        "multi-turn": multi_turn_chat(n // 4, rate / 4, seed=0, ttft_ms=ttft_ms, tpot_ms=tpot_ms),
    }


def tenant_rows(model, hw, scheduler: dict) -> list[dict]:
    """Two tenants on one replica. ``10x``: A sends ShareGPT-like traffic at
    10x B's rate (40 vs 4 req/s, more than the replica serves). ``16k
    flood``: B chats (200-token prompts, 100 outputs, 2 req/s) while A floods
    16k-token prompts at 4 req/s, with an 8192-token budget."""
    b10 = sharegpt_like(400, 4.0, seed=1, tenant="B")
    a10 = sharegpt_like(4000, 40.0, seed=2, tenant="A")
    a = [TraceRequest(t, 16000, 4, tenant="A") for t in poisson_arrivals(40, 4.0, seed=2)]
    b = [
        TraceRequest(t, 200, 100, tenant="B") for t in poisson_arrivals(20, 2.0, seed=1, start=1.0)
    ]
    big = dict(scheduler, max_num_batched_tokens=8192, max_model_len=32768)
    fair = dict(big, fair_share=True, tenant_weights={"B": 7.0})
    runs = {
        ("10x", "B alone"): (b10, scheduler),
        ("10x", "A + B, fcfs"): (merge(a10, b10), scheduler),
        ("10x", "A + B, fair share"): (merge(a10, b10), dict(scheduler, fair_share=True)),
        ("16k flood", "B alone"): (b, big),
        ("16k flood", "A + B, fcfs"): (merge(a, b), big),
        ("16k flood", "A + B, fair share (B weighs 7), no chunk cap"): (
            merge(a, b),
            dict(fair, fair_share_chunk_cap=False),
        ),
        ("16k flood", "A + B, fair share (B weighs 7), chunk cap"): (merge(a, b), fair),
    }
    rows = []
    for (scenario, name), (trace, sched) in runs.items():
        s = simulate(
            trace,
            model=model,
            hardware=hw,
            constants=GPU_DEFAULT_CONSTANTS,
            scheduler=sched,
            cache={"num_blocks": 40000},
        ).summary
        t = s.get("tenants", {})
        b_ = t.get("B", s)
        row = dict(
            scenario=scenario,
            run=name,
            b_ttft_p99_ms=b_["ttft_ms"]["p99"],
            b_tpot_p50_ms=b_["tpot_ms"]["p50"],
            b_tpot_p99_ms=b_["tpot_ms"]["p99"],
            a_ttft_p50_ms=t["A"]["ttft_ms"]["p50"] if "A" in t else None,
            finished=s["finished"],
            duration_s=s["duration_s"],
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests-per-replica", type=int, default=2000)
    p.add_argument("--rate-per-replica", type=float, default=40.0)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--markdown")
    args = p.parse_args()
    model, hw = get_model("qwen3-8b"), get_hardware("h100")
    scheduler = dict(max_num_batched_tokens=2048, max_num_seqs=64)
    rows = []
    for replicas in args.replicas:
        n = args.requests_per_replica * replicas
        for tname, trace in traces(
            n, args.rate_per_replica * replicas, args.ttft_ms, args.tpot_ms
        ).items():
            for pname, opts in POLICIES.items():
                router = "cache-aware" if replicas > 1 else "round-robin"
                s = simulate(
                    trace,
                    model=model,
                    hardware=hw,
                    constants=GPU_DEFAULT_CONSTANTS,
                    scheduler=dict(scheduler, **opts),
                    num_replicas=replicas,
                    router=router,
                ).summary
                row = dict(
                    replicas=replicas,
                    trace=tname,
                    policy=pname,
                    router=router,
                    requests=len(trace),
                    **{
                        k: s[k]
                        for k in (
                            "throughput_req_s",
                            "goodput_req_s",
                            "slo_attainment",
                            "refused",
                            "preemptions",
                            "prefix_hit_rate",
                            "kv_usage_peak",
                            "wall_s",
                        )
                    },
                    ttft_p50_ms=s["ttft_ms"]["p50"],
                    ttft_p99_ms=s["ttft_ms"]["p99"],
                    tpot_p50_ms=s["tpot_ms"]["p50"],
                    tpot_p99_ms=s["tpot_ms"]["p99"],
                    e2e_p99_s=s["e2e_s"]["p99"],
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
    tenants = tenant_rows(model, hw, scheduler)
    if args.markdown:
        recording = json.loads(
            (ROOT / "tests/simulator/data/cpu_calibration_steps.json").read_text()
        )
        fit = fit_recorded(recording)
        write_markdown(Path(args.markdown), rows, tenants, fit, args)


def write_markdown(path: Path, rows, tenants, fit, args) -> None:
    c = GPU_DEFAULT_CONSTANTS
    lines = [
        "# Simulated capacity: Qwen3-8B on an H100-shaped profile",
        "",
        "Generated by `python benchmarks/simulator_study.py --markdown "
        "benchmarks/simulator_results.md` (simulated time; deterministic).",
        "",
        "**These are roofline extrapolations, not H100 measurements.** Step time = "
        "max(FLOPs / (989 TFLOP/s x "
        f"{c.compute_efficiency}), bytes / (3.35 TB/s x {c.memory_efficiency})) + "
        f"{c.step_overhead_s * 1000:.1f} ms per step. The peaks are vendor datasheet "
        "figures; the efficiencies are assumptions; the per-step host overhead comes from "
        "the fit on a CPU recording of a small random-weight Qwen3 "
        "(`tests/simulator/data/cpu_calibration_steps.json`), where the cost model "
        f"predicts measured step times with a mean error of {fit.mean_abs_rel_error:.1%} "
        f"per step and at most {fit.max_group_error:.1%} per batch-shape group "
        f"({len(fit.groups)} groups). No GPU recording has been fitted yet.",
        "",
        f"Workload: {args.requests_per_replica} requests and {args.rate_per_replica} req/s "
        "per replica (ShareGPT-like lognormal lengths, mean ~300 prompt / ~250 output "
        "tokens; `bursty`: gamma gaps with shape 0.25; `multi-turn`: sessions of ~4 turns "
        "resending their history after a shared system prompt). SLO: TTFT "
        f"{args.ttft_ms:.0f} ms and TPOT {args.tpot_ms:.0f} ms; goodput = requests/s "
        "meeting both. Scheduler: 2048-token budget, 64 seqs, prefix caching, KV sized "
        "from 80 GB x 0.9; replicas > 1 use the cache-aware router.",
        "",
        "| replicas | trace | policy | goodput req/s | SLO met | TTFT p50 / p99 ms | "
        "TPOT p50 / p99 ms | E2E p99 s | refused | preempt | prefix hit | KV peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['trace']} | {r['policy']} | {r['goodput_req_s']:.1f} | "
            f"{r['slo_attainment']:.0%} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {r['e2e_p99_s']:.1f} | "
            f"{r['refused']} | {r['preemptions']} | {r['prefix_hit_rate']:.0%} | "
            f"{r['kv_usage_peak']:.0%} |"
        )
    lines += [
        "",
        "Two tenants on one replica, 40,000 KV blocks. `10x`: A sends the ShareGPT-like "
        "traffic above at 40 req/s, 10x B's 4 req/s (same scheduler as above; equal "
        "weights). `16k flood`: B chats (200-token prompts, 100 outputs, 2 req/s) while A "
        "floods 16k-token prompts at 4 req/s, more than the replica serves, with an "
        "8192-token budget; with the chunk cap A's prompt tokens per step are held to its "
        "share (B weighs 7: 1/8 of the budget, 1024) while B has work.",
        "",
        "| scenario | run | B TTFT p99 ms | B TPOT p50 / p99 ms | A TTFT p50 ms | finished | "
        "duration s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in tenants:
        a_ttft = "-" if r["a_ttft_p50_ms"] is None else f"{r['a_ttft_p50_ms']:.0f}"
        lines.append(
            f"| {r['scenario']} | {r['run']} | {r['b_ttft_p99_ms']:.0f} | "
            f"{r['b_tpot_p50_ms']:.1f} / "
            f"{r['b_tpot_p99_ms']:.1f} | {a_ttft} | {r['finished']} | {r['duration_s']:.1f} |"
        )
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
