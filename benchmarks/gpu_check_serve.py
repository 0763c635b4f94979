"""gpu_check.py's section 5 (a real server + remote worker; structured output
on vs off) and the PNG."""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from gpu_check_correct import ensure_graphs
from gpu_check_perf import FULL, QUICK, engine_kwargs


def served_vs_compute(path: str, device: str, quick: bool) -> dict:
    """Output tokens/s served through ``server`` + ``python -m tokenbudget.worker``
    with async scheduling, against the worker's own compute rate (tokens per
    second it was busy, from its Health counters)."""
    import serving as load  # benchmarks/serving.py

    sizes = QUICK if quick else FULL
    concurrency, num_requests, prompt_len, output_len = sizes.serve
    py = sys.executable
    worker, wport = load._spawn([py, "-m", "tokenbudget.worker", "--port", "0"])
    server = None
    try:
        server, sport = load._spawn(
            [py, "-m", "tokenbudget.server", "--model", path, "--port", "0"]
            + ["--worker", f"127.0.0.1:{wport}", "--device", device, "--async-scheduling"]
            # No torch.compile in the worker: its cold compile would eat the budget.
            + ["--enforce-eager"]
            + ["--max-num-seqs", str(concurrency), "--max-model-len", str(sizes.max_model_len)]
            + (["--kv-cache-memory", "64MiB"] if device == "cpu" else [])
        )
        workload = SimpleNamespace(
            seed=0,
            shared_prefix=0,
            num_requests=num_requests,
            prompt_len=str(prompt_len),
            output_len=str(output_len),
        )
        prompts = load.make_prompts(workload, 1000)
        target = f"127.0.0.1:{sport}"
        load.run_load(target, prompts[:concurrency], request_rate=None, concurrency=concurrency)
        before = load._worker_health(f"127.0.0.1:{wport}")
        results, elapsed = load.run_load(
            target, prompts, request_rate=None, concurrency=concurrency
        )
        after = load._worker_health(f"127.0.0.1:{wport}")
    finally:
        for proc in (server, worker):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
    s = load.summarize(results, elapsed)
    busy = after.busy_seconds - before.busy_seconds
    tokens = s["output_tokens_per_s"] * elapsed
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "errors": s["errors"],
        "output_tokens_per_s": round(s["output_tokens_per_s"], 1),
        "worker_compute_tokens_per_s": round(tokens / busy, 1) if busy else None,
        # 1.0: the worker computed the whole time (the front never made it wait).
        "served_over_compute": round(busy / elapsed, 3),
        "worker_steps": after.num_steps - before.num_steps,
        "tpot_p50_ms": round(s["tpot"].get("p50_ms", 0.0), 2),
        "pass": s["errors"] == 0 and tokens > 0,
    }


def structured_output(path: str, device: str, quick: bool) -> dict:
    """Tokens/s with every request JSON-schema constrained vs none (same
    lengths: EOS ignored), interleaved runs, the medians compared."""
    if importlib.util.find_spec("xgrammar") is None:
        return {"skipped": "xgrammar missing (benchmarks/gpu_wheels.sh carries it)"}
    from structured_output import LONG_SCHEMA  # benchmarks/structured_output.py

    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    sizes = QUICK if quick else FULL
    n, max_tokens = (4, 8) if quick else (64, 64)
    llm = LLM(path, **engine_kwargs(device, quick, sizes))
    try:
        info = ensure_graphs(llm, True)
        rng = np.random.default_rng(3)
        prompts = [{"prompt_token_ids": rng.integers(16, 1000, 64).tolist()} for _ in range(n)]

        def params(spec):
            return [
                SamplingParams(
                    temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, structured=spec
                )
                for i in range(n)
            ]

        spec = {"json_schema": LONG_SCHEMA}
        llm.generate(prompts[:2], params(spec)[:2])  # the grammar compiles here, untimed
        runs: dict[str, list[float]] = {"none": [], "json_schema": []}
        for _ in range(2 if quick else 3):
            for label, structured in (("none", None), ("json_schema", spec)):
                t0 = time.perf_counter()
                llm.generate(prompts, params(structured))
                runs[label].append(time.perf_counter() - t0)
    finally:
        llm.shutdown()
    rate = {k: n * max_tokens / statistics.median(v) for k, v in runs.items()}
    return {
        **info,
        "none_tokens_per_s": round(rate["none"], 1),
        "json_schema_tokens_per_s": round(rate["json_schema"], 1),
        "json_schema_over_none": round(rate["json_schema"] / rate["none"], 3),
    }


def plot(data: dict, path: Path) -> dict:
    """Decode tokens/s and roofline fraction per backend and batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"skipped": "matplotlib not installed"}
    runs = {
        name: entry
        for name, entry in data["sections"].get("throughput", {}).items()
        if entry.get("status") == "ok" and any(k.startswith("decode_b") for k in entry)
    }
    if not runs:
        return {"skipped": "no throughput run finished"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, entry in runs.items():
        keys = sorted((k for k in entry if k.startswith("decode_b")), key=lambda k: int(k[8:]))
        xs = [int(k[8:]) for k in keys]
        left.plot(xs, [entry[k]["tokens_per_s"] for k in keys], marker="o", label=name)
        right.plot(xs, [entry[k]["hbm_roofline_fraction"] or 0 for k in keys], marker="o")
    left.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s")
    right.set(xscale="log", xlabel="batch", ylabel="fraction of measured HBM roofline")
    left.legend()
    gpu = data["sections"].get("environment", {}).get("environment", {}).get("gpu")
    fig.suptitle(f"gpu_check on {gpu or data['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"file": path.name}
