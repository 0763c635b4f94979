"""python -m tokenbudget.server.sim {simulate,calibrate} ...

simulate: a trace through N simulated replicas of a model on a hardware
profile; prints a JSON summary (TTFT/TPOT/E2E percentiles, goodput under the
SLO, preemptions, KV usage), writes the full result with --out and a plot
with --plot (matplotlib, the [bench] extra).

calibrate: measure real worker steps (a small CPU model by default), fit the
cost model's constants, print the fit error; --fit PATH fits a recording
without measuring.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenbudget.core.config import POLICIES
from tokenbudget.server.sim.profiles import (
    GPU_DEFAULT_CONSTANTS,
    HARDWARE,
    MODELS,
    CostConstants,
    get_hardware,
    get_model,
)
from tokenbudget.server.sim.simulate import ROUTERS, simulate
from tokenbudget.server.engine.trace import load_trace
from tokenbudget.server.sim.traces import multi_turn_chat, sharegpt_like

TRACES = ("sharegpt", "multi-turn", "replay")


def make_trace(args: argparse.Namespace) -> list:
    if args.trace == "sharegpt":
        return sharegpt_like(
            args.num_requests,
            args.rate,
            seed=args.seed,
            burstiness=args.burstiness,
            ttft_ms=args.ttft_ms,
            tpot_ms=args.tpot_ms,
        )
    if args.trace == "multi-turn":
        # Sessions average ~4 turns: start a quarter as many sessions per second.
        return multi_turn_chat(
            max(args.num_requests // 4, 1),
            args.rate / 4,
            seed=args.seed,
            ttft_ms=args.ttft_ms,
            tpot_ms=args.tpot_ms,
        )
    if not args.trace_file:
        sys.exit("simulate: --trace replay needs --trace-file (a recorded trace)")
    trace, block_size = load_trace(args.trace_file)
    if block_size != args.block_size:
        sys.exit(
            f"simulate: the trace was recorded with block size {block_size}; "
            f"pass --block-size {block_size}"
        )
    return trace[: args.num_requests] if args.num_requests else trace


def plot(result, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install -e '.[bench]'")
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, series in enumerate(result.kv_usage):
        if series:
            t, u = zip(*series)
            ax1.plot(t, np.array(u) * 100, label=f"replica {i}")
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel("KV cache usage (%)")
    ax1.legend(fontsize="small")
    ttft = np.array([x for x in result.ttft_s if x == x]) * 1000
    if len(ttft):
        ax2.hist(ttft, bins=60)
    ax2.set_xlabel("TTFT (ms)")
    ax2.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cmd_simulate(args: argparse.Namespace) -> None:
    constants = GPU_DEFAULT_CONSTANTS
    if args.constants:
        with open(args.constants) as f:
            data = json.load(f)
        constants = CostConstants(**data.get("constants", data))
    trace = make_trace(args)
    scheduler = dict(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        policy=args.policy,
        fair_share=args.fair_share,
        fair_share_chunk_cap=not args.no_fair_share_chunk_cap,
        slo_reject_late=args.reject_late,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    cache = dict(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    result = simulate(
        trace,
        model=get_model(args.model),
        hardware=get_hardware(args.hardware),
        constants=constants,
        scheduler=scheduler,
        cache=cache,
        num_replicas=args.replicas,
        router=args.router,
        seed=args.seed,
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
    )
    summary = dict(
        result.summary,
        model=args.model,
        hardware=args.hardware,
        trace=args.trace,
        policy=args.policy,
        fair_share=args.fair_share,
        replicas=args.replicas,
        router=args.router,
        constants=constants.to_dict(),
    )
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(result.to_dict(), summary=summary), f)
    if args.plot:
        plot(result, args.plot)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from tokenbudget.server.sim.calibrate import fit_recorded, measure

    if args.fit:
        with open(args.fit) as f:
            recording = json.load(f)
    else:
        recording = measure(repeats=args.repeats, threads=args.threads, device=args.device)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(recording, f)
    report = fit_recorded(recording)
    print(json.dumps(dict(report.to_dict(), num_steps=len(recording["steps"]))))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tokenbudget.server.sim", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="simulate a trace on N replicas")
    s.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    s.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    s.add_argument("--constants", help="JSON of CostConstants (or calibrate's output)")
    s.add_argument("--trace", default="sharegpt", choices=TRACES)
    s.add_argument("--trace-file", help="--trace replay: a file TraceRecorder saved")
    s.add_argument("--num-requests", type=int, default=1000)
    s.add_argument("--rate", type=float, default=10.0, help="requests per second")
    s.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, < 1 burstier",
    )
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--router", default="round-robin", choices=ROUTERS)
    s.add_argument("--policy", default="fcfs", choices=POLICIES)
    s.add_argument("--fair-share", action="store_true")
    s.add_argument(
        "--no-fair-share-chunk-cap",
        action="store_true",
        help="--fair-share: let a tenant's prompt chunks take more than its "
        "weighted share of a step's token budget",
    )
    s.add_argument(
        "--reject-late",
        action="store_true",
        help="policy slo: refuse requests that cannot meet their TTFT",
    )
    s.add_argument("--ttft-ms", type=float, default=None, help="TTFT target (SLO)")
    s.add_argument("--tpot-ms", type=float, default=None, help="TPOT target (SLO)")
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-model-len", type=int, default=16384)
    s.add_argument("--long-prefill-token-threshold", type=int, default=0)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (default: from the hardware's memory)",
    )
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", help="write the full result (JSON)")
    s.add_argument("--plot", help="write a PNG: KV usage over time, TTFT histogram")
    s.set_defaults(func=cmd_simulate)
    _add_calibrate_parser(sub)
    args = p.parse_args(argv)
    args.func(args)


def _add_calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="measure worker steps and fit the constants")
    c.add_argument("--fit", help="fit this recording instead of measuring")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--device", default="cpu")
    c.add_argument("--out", help="write the recording (JSON)")
    c.set_defaults(func=cmd_calibrate)


if __name__ == "__main__":
    main()
