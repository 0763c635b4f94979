#!/usr/bin/env python3
"""The prepared GPU check (DESIGN.md §8): one command, JSON and a PNG in ``--out``.

    bash benchmarks/gpu_wheels.sh            # once, here: the wheels the GPU machine lacks
    python benchmarks/gpu_check.py --out benchmarks/out/gpu   # there, <= 8 minutes on an H100
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc   # CI: same code, tiny model

Sections, in order, each item under its own time limit (a slow item is cut
and recorded as ``"status": "timeout"``, and the rest still runs; the JSON is
rewritten after every item, so a run killed from outside leaves what it had):

1. environment: GPU, torch / CUDA / triton versions, which extras import;
2. correctness: every attention backend vs SDPA on random paged batches;
   greedy tokens of a tiny model equal transformers with CUDA graphs on and
   off; the suite's GPU-only tests (``-k "cuda or flash or triton or gpu"``);
3. KV sizing: blocks the memory profile gave vs the arithmetic;
4. throughput of a Qwen3-0.6B-shaped model with random bf16 weights through
   ``LLM``, per backend: decode at batch 1 / 64 / 256 with 1k context
   (tokens/s, ms/step, share of the step outside the forward, fraction of the
   HBM roofline measured by a device-to-device copy), prefill 8 x 2k;
5. serving: a real ``server`` + remote worker with async scheduling (served
   rate vs the worker's compute rate), structured output on vs off.

Every item's entry has ``status`` (ok, skipped, timeout, error) and
``seconds``; items that check something have ``pass``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use_working_tree() -> None:
    """Import ``tokenbudget`` from this checkout (its root is the package),
    here and in the processes started, rather than an installed copy."""
    link = Path(tempfile.gettempdir()) / f"tokenbudget_src_{os.getuid()}" / "tokenbudget"
    if link.is_symlink() and link.resolve() != ROOT:  # another checkout's
        link.unlink()
    if not link.exists():
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(ROOT, target_is_directory=True)
    sys.path.insert(0, str(link.parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(link.parent), os.environ.get("PYTHONPATH")) if p
    )


use_working_tree()

import gpu_check_correct as correct  # noqa: E402  (after the path is set)
import gpu_check_perf as perf  # noqa: E402
import gpu_check_serve as serve  # noqa: E402

# Ceilings in seconds per item on an H100 (quick CPU runs use QUICK_BUDGET_S),
# well above what each should take (about 5 minutes in all). No item starts
# after TOTAL_BUDGET_S, and each is cut at what is left of it, so the run
# ends inside 8 minutes whatever hangs.
BUDGET_S = {
    "environment": 20,
    "backends_vs_sdpa": 40,
    "greedy_vs_transformers": 50,
    "gpu_tests": 90,
    "model": 30,
    "kv_sizing": 20,
    "hbm_bandwidth": 10,
    "attention_decode": 25,
    "throughput": 70,  # per backend
    "throughput_eager": 35,
    "served_vs_compute": 75,
    "structured_output": 45,
}
QUICK_BUDGET_S = 150  # per item: a loaded 2-core CI box starts a server slowly
TOTAL_BUDGET_S = 450


class ItemTimeout(Exception):
    """Raised in the main thread when an item outlives its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise ItemTimeout(f"cut after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Report:
    """The JSON being built, written to ``out/gpu_check.json`` after every item."""

    def __init__(self, out: Path, args) -> None:
        self.out, self.quick = out, args.quick
        self.total_s = 3600 if args.quick else TOTAL_BUDGET_S  # CPU: only a hang is cut
        self.t0 = time.perf_counter()
        self.data: dict = {
            "device": args.device,
            "quick": args.quick,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "sections": {},
        }

    def run(self, section: str, item: str, fn: Callable[[], dict], budget: str | None = None):
        """Run one item under its time limit; record its result, error or timeout."""
        limit = QUICK_BUDGET_S if self.quick else BUDGET_S[budget or item]
        left = self.total_s - (time.perf_counter() - self.t0)
        t0 = time.perf_counter()
        if left < 5:
            entry: dict = {"status": "skipped", "skipped": "the run's time budget is spent"}
        else:
            try:
                with time_limit(min(limit, left)):
                    entry = dict(fn() or {})
                entry.setdefault("status", "skipped" if "skipped" in entry else "ok")
            except ItemTimeout as exc:
                entry = {"status": "timeout", "error": str(exc)}
            except Exception as exc:  # recorded; the next item still runs
                entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
                entry["traceback"] = traceback.format_exc(limit=-6)[-3000:]
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        release_memory()
        self.data["sections"].setdefault(section, {})[item] = entry
        print(f"[gpu_check] {section}.{item}: {entry['status']} ({entry['seconds']} s)", flush=True)
        self.write()
        return entry

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str))


def release_memory() -> None:
    """What an item left (engines, models) goes before the next one sizes its KV."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- 1. environment -------------------------------------------------------------------------
def environment(device: str) -> dict:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
    }
    for name in ("triton", "xgrammar", "flash_attn", "flashinfer"):
        try:
            env[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception as exc:  # absent, or a build that does not load here
            env[name] = None if isinstance(exc, ImportError) else f"broken: {exc}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            num_sms=props.multi_processor_count,
        )
    else:
        env["gpu"] = None
    return env


# -- 2. correctness ---------------------------------------------------------------------------
def backends_vs_sdpa(device: str, quick: bool) -> dict:
    """Each in-place backend usable here against the SDPA reference, on seeded
    random paged batches mixing decodes, prompt chunks and shared blocks."""
    import torch

    from tokenbudget.worker.attention import _PAGED_KERNEL_MODULES, paged_kernel

    dev = torch.device(device)
    results, ok = {}, True
    for backend in (*_PAGED_KERNEL_MODULES, "flash_attn"):
        problem = correct.backend_problem(backend, dev)
        if problem:
            results[backend] = {"skipped": problem}
            continue
        kernel = None if backend == "flash_attn" else paged_kernel(backend)
        per_dtype = {}
        for dtype in (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16,):
            err, tol = correct.compare_backend(backend, kernel, dev, dtype, 8 if quick else 40)
            per_dtype[str(dtype).split(".")[-1]] = {"max_abs_err": err, "tolerance": tol}
            ok &= err <= tol
        results[backend] = {
            "dtypes": per_dtype,
            "pass": all(v["max_abs_err"] <= v["tolerance"] for v in per_dtype.values()),
        }
    return {"backends": results, "pass": bool(ok)}


def greedy_vs_transformers(device: str, quick: bool, work: Path) -> dict:
    """Greedy tokens of a tiny fp32 model through LLM, CUDA graphs off then on,
    against transformers' generate()."""
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    path = build_tiny_qwen3(work / "tiny_qwen3", seed=0)
    prompts, want = correct.hf_greedy(path, device, num_prompts=3 if quick else 8, new_tokens=8)
    runs, ok = {}, True
    for graphs in (False, True):
        got, info = correct.llm_greedy(path, device, prompts, 8, graphs)
        match = sum(a == b for a, b in zip(got, want))
        # On CUDA graphs must have replayed; on CPU only with an in-place backend.
        must_replay = graphs and (device == "cuda" or info["graphs"].startswith("stubbed"))
        passed = match == len(want) and (not must_replay or info["graph_replays"] > 0)
        runs["graphs_on" if graphs else "graphs_off"] = {
            "requests_matching": match,
            "requests": len(want),
            **info,
            "pass": passed,
        }
        ok &= passed
    return {**runs, "pass": bool(ok)}


def gpu_tests(device: str, quick: bool) -> dict:
    """The suite's tests that need a GPU (they skip on CPU, so CI never runs them)."""
    if device != "cuda":
        return {"skipped": "the GPU-only tests skip without CUDA"}
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    # Not test_gpu_check.py: it runs this script's CPU quick mode.
    select = "(cuda or flash or triton or gpu) and not gpu_check"
    cmd += ["--continue-on-collection-errors", "-k", select, "tests"]
    try:
        proc = subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, timeout=BUDGET_S["gpu_tests"] - 10
        )
    except subprocess.TimeoutExpired as exc:
        return {"status": "timeout", "error": "pytest timed out", "tail": str(exc.stdout)[-2000:]}
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    counts = correct.pytest_counts(tail[0])
    return {
        "rc": proc.returncode,
        "summary": tail[0],
        **counts,
        "tail": (proc.stdout + proc.stderr)[-2500:],
        "pass": proc.returncode == 0 and counts.get("passed", 0) > 0,
    }


# -- 3-5: KV sizing, throughput, serving ------------------------------------------------
def run_perf_sections(report: Report, dev: str, quick: bool, work: Path, backends) -> None:
    model = report.run("throughput", "model", lambda: perf.make_model(work, dev, quick))
    if model["status"] != "ok":
        return
    path = model["path"]
    report.run("kv_sizing", "kv_sizing", lambda: perf.kv_sizing(path, dev, quick))
    bw = report.run("throughput", "hbm_bandwidth", lambda: perf.bandwidth(dev, quick))
    gbps = bw.get("gb_per_s")
    report.run("throughput", "attention_decode", lambda: perf.attention_decode(dev, quick))
    timed = perf.timed_backends(dev, backends)
    for backend in timed:
        report.run(
            "throughput",
            backend,
            lambda b=backend: perf.throughput(path, dev, quick, b, gbps),
            budget="throughput",
        )
        if backend == timed[0] and backend in ("triton", "cpu"):  # graphs off, for comparison
            report.run(
                "throughput",
                f"{backend}_eager",
                lambda b=backend: perf.throughput(path, dev, quick, b, gbps, graphs=False),
                budget="throughput_eager",
            )
    report.run("serving", "served_vs_compute", lambda: serve.served_vs_compute(path, dev, quick))
    report.run("serving", "structured_output", lambda: serve.structured_output(path, dev, quick))


# -- the run ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.png")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny model and sizes (CI, < 60 s)")
    p.add_argument("--work", default=None, help="scratch folder for models (default: a temp dir)")
    p.add_argument(
        "--backends", default=None, help="comma-separated backends to time (default: all usable)"
    )
    args = p.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Models and checkpoints stay out of --out: only the report comes back.
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    report = Report(out, args)
    dev, quick = args.device, args.quick
    report.run("environment", "environment", lambda: environment(dev))
    report.run("correctness", "backends_vs_sdpa", lambda: backends_vs_sdpa(dev, quick))
    report.run(
        "correctness", "greedy_vs_transformers", lambda: greedy_vs_transformers(dev, quick, work)
    )
    run_perf_sections(report, dev, quick, work, args.backends)
    # Last: the slowest and least specific item gets whatever time is left.
    report.run("correctness", "gpu_tests", lambda: gpu_tests(dev, quick))
    report.data["plot"] = serve.plot(report.data, out / "gpu_check.png")
    report.write()
    print(json.dumps({"out": str(out / "gpu_check.json"), "elapsed_s": report.data["elapsed_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
