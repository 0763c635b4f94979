#!/usr/bin/env python3
"""Serving benchmarks against the gRPC server (README.md, Benchmarks).

    # load generator against a running server
    python benchmarks/serving.py load --target localhost:50051 --num-requests 200 \\
        --request-rate 20 --prompt-len 128:512 --output-len 32:128 --shared-prefix 64 \\
        --out results/serving.json --plot results/serving.png
    python benchmarks/serving.py load --target localhost:50051 --concurrency 32 ...

    # per-step protobuf encode + decode vs the scheduler's own step time
    python benchmarks/serving.py codec --sizes 64 256 1024

    # tokens/s with async scheduling on vs off, remote worker on this machine,
    # and the worker's idle fraction (starts worker + server processes itself)
    python benchmarks/serving.py async-compare [--model PATH] --concurrency 32

Every mode prints one JSON object per result line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


# -- load generator ------------------------------------------------------------------
@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def _length(spec: str, rng: random.Random) -> int:
    lo, _, hi = spec.partition(":")
    return rng.randint(int(lo), int(hi or lo))


def make_prompts(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(3, vocab) for _ in range(args.shared_prefix)]
    out = []
    for _ in range(args.num_requests):
        n = max(1, _length(args.prompt_len, rng) - len(prefix))
        out.append(
            (prefix + [rng.randrange(3, vocab) for _ in range(n)], _length(args.output_len, rng))
        )
    return out


async def run_one(stub, prompt: list[int], max_tokens: int) -> RequestResult:
    from tokenbudget.core import SamplingParams
    from tokenbudget.server.entrypoints.client import make_request

    r = RequestResult(len(prompt), start=time.perf_counter())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    last = r.start
    try:
        async for msg in stub.Generate(make_request(prompt, params)):
            now = time.perf_counter()
            if msg.token_ids:
                if r.ttft is None:
                    r.ttft = now - r.start
                else:
                    # Tokens that arrived together share the gap.
                    r.itl.extend([(now - last) / len(msg.token_ids)] * len(msg.token_ids))
                last = now
                r.output_len += len(msg.token_ids)
        r.e2e = time.perf_counter() - r.start
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        r.error = str(exc)
    return r


def run_load(
    target: str, prompts, *, request_rate: float | None, concurrency: int | None, seed: int = 0
) -> tuple[list[RequestResult], float]:
    """Stream every prompt, all in flight at once, at ``request_rate`` (Poisson)
    or ``concurrency`` at a time. The clients are coroutines on one grpc.aio
    channel: a thread per stream would cost the client about twice the CPU per
    received message, which on a small machine is taken from the server."""
    return asyncio.run(_run_load(target, prompts, request_rate, concurrency, seed))


async def _run_load(
    target: str, prompts, request_rate: float | None, concurrency: int | None, seed: int
) -> tuple[list[RequestResult], float]:
    import grpc

    from tokenbudget.proto import generate_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        if concurrency:
            it = iter(prompts)

            async def loop() -> list[RequestResult]:
                return [await run_one(stub, *item) for item in it]

            batches = await asyncio.gather(*(loop() for _ in range(concurrency)))
            results = [r for batch in batches for r in batch]
        else:
            rng = random.Random(seed)

            async def fire(item, at: float) -> RequestResult:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                return await run_one(stub, *item)

            delays = itertools.accumulate(
                (rng.expovariate(request_rate) if request_rate else 0.0 for _ in prompts),
                initial=0.0,
            )
            results = list(await asyncio.gather(*(fire(p, d) for p, d in zip(prompts, delays))))
        return results, time.perf_counter() - t0


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)

    def p(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    return {
        "mean_ms": statistics.fmean(values) * 1000,
        "p50_ms": p(0.5),
        "p90_ms": p(0.9),
        "p99_ms": p(0.99),
    }


def summarize(results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.error is None]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    out_tokens = sum(r.output_len for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + sum(r.prompt_len for r in ok)) / elapsed,
        "ttft": _pcts([r.ttft for r in ok if r.ttft is not None]),
        "tpot": _pcts(tpot),
        "itl": _pcts([x for r in ok for x in r.itl]),
        "e2e": _pcts([r.e2e for r in ok]),
    }


def plot(results: list[RequestResult], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot (pip install matplotlib)"
    ok = [r for r in results if r.error is None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, values) in zip(
        axes,
        [
            ("TTFT (ms)", [r.ttft * 1000 for r in ok if r.ttft is not None]),
            ("ITL (ms)", [x * 1000 for r in ok for x in r.itl]),
            ("end-to-end (ms)", [r.e2e * 1000 for r in ok]),
        ],
    ):
        ax.hist(values, bins=50)
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def cmd_load(args) -> None:
    from tokenbudget.server.entrypoints.client import Client

    with Client(args.target) as c:
        info = c.model_info()
    results, elapsed = run_load(
        args.target,
        make_prompts(args, info.vocab_size),
        request_rate=args.request_rate,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    summary = {"mode": "load", "model": info.model, **summarize(results, elapsed)}
    if args.plot:
        summary["plot"] = plot(results, args.plot)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"summary": summary, "requests": [asdict(r) for r in results]}, indent=1)
        )
    print(json.dumps(summary))


# -- codec overhead ---------------------------------------------------------------------
class _GCTimer:
    """Collector passes and their time while ``active`` (gc.callbacks)."""

    def __init__(self) -> None:
        self.active = False
        self.passes = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.active:
            self.passes[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start


def cmd_codec(args) -> None:
    import gc

    from tokenbudget.core import (
        CacheConfig,
        ModelRunnerOutput,
        Request,
        SamplingParams,
        Scheduler,
        SchedulerConfig,
    )
    from tokenbudget.core.utils.gc_policy import configure_gc
    from tokenbudget.proto import step_stream, worker_pb2

    rng = random.Random(0)
    default_thresholds = gc.get_threshold()
    for n in args.sizes:
        sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=n, max_model_len=1024),
            CacheConfig(block_size=16, num_blocks=n * 48 + 16),
        )
        # The server's policy, applied where the server applies it: after the
        # engine (block pool included) is built, before requests arrive.
        gc.set_threshold(*default_thresholds)
        gc.unfreeze()
        policy = configure_gc() if args.gc == "server" else None
        for i in range(n):
            sched.add_request(
                Request(
                    f"req-{i}",
                    [rng.randrange(1, 32000) for _ in range(512)],
                    SamplingParams(max_tokens=256, ignore_eos=True),
                )
            )
        # The engine's encoder and a worker's decoder: they share request handles.
        encoder, decoder = (
            step_stream.SchedulerOutputEncoder(),
            step_stream.SchedulerOutputDecoder(),
        )
        reply_decoder = step_stream.ModelRunnerOutputDecoder()
        t = {"schedule": 0.0, "update": 0.0, "encode": 0.0, "decode": 0.0, "wire": 0.0}
        gc_timer = _GCTimer()
        gc.callbacks.append(gc_timer)
        steps = 0
        while sched.has_unfinished_requests():
            a = time.perf_counter()
            so = sched.schedule()
            b = time.perf_counter()
            msg = encoder.encode(so)
            b1 = time.perf_counter()
            wire = msg.SerializeToString()
            c = time.perf_counter()
            msg = worker_pb2.SchedulerOutput.FromString(wire)
            c1 = time.perf_counter()
            so2 = decoder.decode(msg)
            d = time.perf_counter()
            # What the worker answers: one token per request whose prefill is done.
            req_ids = list(so2.num_scheduled_tokens)
            done = [
                sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                for r in req_ids
            ]
            mro = ModelRunnerOutput(
                req_ids, {r: i for i, r in enumerate(req_ids)}, [[7] if x else [] for x in done]
            )
            steady = all(done) and len(req_ids) == n  # steady decode steps only are timed
            gc_timer.active = steady
            e = time.perf_counter()
            msg = step_stream.model_runner_output_to_proto(mro, 0, req_ids)
            e1 = time.perf_counter()
            wire2 = msg.SerializeToString()
            f = time.perf_counter()
            msg = worker_pb2.ModelRunnerOutput.FromString(wire2)
            f1 = time.perf_counter()
            mro2 = reply_decoder.decode(msg, list(so.num_scheduled_tokens))
            g = time.perf_counter()
            sched.update_from_output(so, mro2)
            h = time.perf_counter()
            if steady:
                steps += 1
                t["schedule"] += b - a
                t["encode"] += (c - b) + (f - e)
                t["decode"] += (d - c) + (g - f)
                t["update"] += h - g
                t["wire"] += (c - b1) + (c1 - c) + (f - e1) + (f1 - f)
                sizes = (len(wire), len(wire2))
        gc.callbacks.remove(gc_timer)
        per = {k: v / steps * 1e6 for k, v in t.items()}
        sched_us = per["schedule"] + per["update"]
        codec_us = per["encode"] + per["decode"]
        print(
            json.dumps(
                {
                    "mode": "codec",
                    "running": n,
                    "steps": steps,
                    "gc": (
                        {
                            "policy": "server (configure_gc)",
                            "thresholds": policy.thresholds,
                            "frozen": policy.frozen,
                        }
                        if policy
                        else {"policy": "CPython default", "thresholds": default_thresholds}
                    ),
                    "scheduler_us": round(sched_us, 1),
                    "encode_us": round(per["encode"], 1),
                    "decode_us": round(per["decode"], 1),
                    "codec_over_scheduler": round(codec_us / sched_us, 3),
                    # of the codec, protobuf's own serialize + parse (the
                    # rest is converting to and from the engine's dataclasses)
                    "wire_us": round(per["wire"], 1),
                    "wire_over_scheduler": round(per["wire"] / sched_us, 3),
                    "gc_passes_by_generation": gc_timer.passes,
                    "gc_us_per_step": round(gc_timer.seconds / steps * 1e6, 1),
                    "step_bytes": {"scheduler_output": sizes[0], "model_runner_output": sizes[1]},
                }
            )
        )


# -- async on vs off ----------------------------------------------------------------------
def _spawn(argv: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if " listening on " in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, int(line.rsplit(":", 1)[1])
    raise RuntimeError(f"{argv[0]} exited with {proc.wait()}")


def _worker_health(address: str):
    import grpc

    from tokenbudget.proto import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest())


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default), threads included."""
    if pid is None:
        return time.process_time()
    # /proc/PID/stat fields 14 and 15 (utime, stime), after the parenthesised name.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
    """CPU seconds all processes on this machine spent busy (summed over cores)."""
    user, nice, system, _idle, _iowait, *rest = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    )
    return (user + nice + system + sum(rest[:3])) / os.sysconf("SC_CLK_TCK")


def cmd_async_compare(args) -> None:
    from tokenbudget.server.entrypoints.demo import ensure_demo_model

    model = args.model or ensure_demo_model()
    bin_dir = Path(sys.executable).parent
    for async_on in (True, False):
        worker, wport = _spawn(
            [
                sys.executable,
                "-m",
                "tokenbudget.worker",
                "--port",
                "0",
                "--threads",
                str(args.threads),
            ]
        )
        server, sport = _spawn(
            [
                str(bin_dir / "server"),
                "--model",
                model,
                "--port",
                "0",
                "--worker",
                f"127.0.0.1:{wport}",
                *([] if async_on else ["--no-async-scheduling"]),
            ]
        )
        try:
            target = f"127.0.0.1:{sport}"
            run_load(
                target,
                make_prompts(args, 1000)[: args.concurrency],
                request_rate=None,
                concurrency=args.concurrency,
            )  # warm-up
            before = _worker_health(f"127.0.0.1:{wport}")
            procs = {"server": server.pid, "worker": worker.pid, "client": None}
            cpu = {name: _cpu_seconds(pid) for name, pid in procs.items()}
            machine = _machine_busy_seconds()
            results, elapsed = run_load(
                target, make_prompts(args, 1000), request_rate=None, concurrency=args.concurrency
            )
            cpu = {name: round(_cpu_seconds(pid) - cpu[name], 2) for name, pid in procs.items()}
            # Whatever else ran meanwhile (other users of a shared machine).
            cpu["others"] = round(
                max(0.0, _machine_busy_seconds() - machine - sum(cpu.values())), 2
            )
            after = _worker_health(f"127.0.0.1:{wport}")
        finally:
            server.terminate()
            worker.terminate()
            server.wait(60)
            worker.wait(60)
        busy = after.busy_seconds - before.busy_seconds
        wall = after.wall_seconds - before.wall_seconds
        s = summarize(results, elapsed)
        tokens = s["output_tokens_per_s"] * elapsed
        print(
            json.dumps(
                {
                    "mode": "async-compare",
                    "async_scheduling": async_on,
                    "output_tokens_per_s": round(s["output_tokens_per_s"], 1),
                    "worker_steps": after.num_steps - before.num_steps,
                    "worker_idle_fraction": round(1 - busy / wall, 3) if wall else None,
                    "worker_compute_tokens_per_s": round(tokens / busy, 1) if busy else None,
                    # Busy seconds are wall time: on a machine where the worker waits
                    # for a core, they include the wait and flatter the ratio below.
                    # Tokens per worker CPU second (its whole process, so slightly low)
                    # is the compute rate the worker would reach with a core to itself.
                    "served_over_compute": round(busy / elapsed, 3) if busy else None,
                    "worker_cpu_tokens_per_s": (
                        round(tokens / cpu["worker"], 1) if cpu["worker"] else None
                    ),
                    "served_over_worker_cpu_rate": (
                        round(cpu["worker"] / elapsed, 3) if cpu["worker"] else None
                    ),
                    "tpot_p50_ms": round(s["tpot"].get("p50_ms", 0.0), 2),
                    "errors": s["errors"],
                    # Which process ate the CPU: on a machine with few cores, server +
                    # client + worker CPU seconds close to cores x duration means the
                    # worker waits for a core, not for the server.
                    "duration_s": round(elapsed, 2),
                    "worker_busy_s": round(busy, 2),
                    "cpu_s": cpu,
                    "cpu_cores_used": round(sum(cpu.values()) / elapsed, 2),
                    "cpu_cores": os.cpu_count(),
                }
            )
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="mode", required=True)

    def workload_flags(q) -> None:
        q.add_argument("--num-requests", type=int, default=200)
        q.add_argument("--prompt-len", default="64:256", help="N or LO:HI (uniform)")
        q.add_argument("--output-len", default="16:64", help="N or LO:HI (uniform)")
        q.add_argument(
            "--shared-prefix",
            type=int,
            default=0,
            help="tokens every prompt starts with (prefix caching)",
        )
        q.add_argument("--seed", type=int, default=0)

    q = sub.add_parser("load", help="load generator against a running server")
    q.add_argument("--target", default="localhost:50051")
    arrival = q.add_mutually_exclusive_group()
    arrival.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (default: all at once)",
    )
    arrival.add_argument(
        "--concurrency", type=int, default=None, help="fixed number of requests in flight"
    )
    workload_flags(q)
    q.add_argument("--out", help="write the summary and per-request records as JSON")
    q.add_argument("--plot", help="write TTFT/ITL/e2e histograms as a PNG")

    q = sub.add_parser("codec", help="protobuf encode+decode per step vs scheduler step")
    q.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    q.add_argument(
        "--gc",
        choices=["server", "default"],
        default="server",
        help="collector policy: the server's (configure_gc, the default) or "
        "CPython's untouched defaults, for comparison",
    )

    q = sub.add_parser("async-compare", help="tokens/s async on vs off, remote worker")
    q.add_argument("--model", help="checkpoint (default: the demo model)")
    q.add_argument("--concurrency", type=int, default=32)
    q.add_argument("--threads", type=int, default=1, help="worker torch threads")
    workload_flags(q)
    args = p.parse_args(argv)
    {"load": cmd_load, "codec": cmd_codec, "async-compare": cmd_async_compare}[args.mode](args)


if __name__ == "__main__":
    main()
