"""Start-up cost of the compiled decoder: each case in a fresh process, LLM
construction to first token, with an empty inductor cache (cold) and again
with the cache it left (warm), beside an eager start.

    python benchmarks/compile_cost.py --rounds 2

Prints JSON: seconds per case (median of rounds) and the compiled decoder's
own compile time; ``--freeze`` measures with inductor freezing (whose graphs
the on-disk FX graph cache does not keep).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
import tokenbudget.worker.compiled as compiled
compiled.FREEZE_ON_CPU = sys.argv[4] == "1"
from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM
t0 = time.perf_counter()
llm = LLM(sys.argv[1], dtype="float32", device="cpu", num_gpu_blocks=256,
          enforce_eager=sys.argv[2] == "eager")
start = time.perf_counter() - t0
llm.generate({"prompt_token_ids": list(range(20, 52))}, SamplingParams(max_tokens=4))
first = time.perf_counter() - t0
dec = llm.engine.executor.worker.model_runner.compiled
print(json.dumps({"startup_s": start, "first_output_s": first,
                  "compile_s": dec.compile_seconds if dec else 0.0}))
"""


def run_case(model: str, mode: str, cache_dir: str, threads: int, freeze: bool) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model, mode, str(threads), "1" if freeze else "0"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint; default: the tiny local Qwen3")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", "--torch-threads", type=int, default=1)
    p.add_argument("--freeze", action="store_true", help="compile with inductor freezing")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

            model = build_tiny_qwen3(os.path.join(tmp, "model"))
        cases: dict[str, list[dict]] = {"eager": [], "compiled_cold": [], "compiled_warm": []}
        for r in range(args.rounds):
            cache = os.path.join(tmp, f"inductor{r}")
            freeze = args.freeze
            cases["eager"].append(run_case(model, "eager", cache, args.threads, freeze))
            cases["compiled_cold"].append(run_case(model, "compiled", cache, args.threads, freeze))
            cases["compiled_warm"].append(run_case(model, "compiled", cache, args.threads, freeze))
    report = {
        "threads": args.threads,
        "freeze": args.freeze,
        "rounds": args.rounds,
        **{
            name: {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
            for name, runs in cases.items()
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
