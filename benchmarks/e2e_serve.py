"""``e2e_vs_vllm.py --serve``: vLLM's own load generator, ``vllm bench serve
--backend openai-chat``, against our server behind the SGLang gateway (OpenAI
HTTP -> gRPC, as in ``gateway.py``) and against ``vllm serve``, in turn.

Random 128-token prompts -> 128 tokens (ignore_eos), Poisson arrivals at
``--request-rate``, ``--num-prompts`` requests, the same seed for both. Each
round starts fresh servers (engine order alternating); reported: TPOT, TTFT
and end-to-end p50, output tokens/s, the CPU-seconds per output token of the
serving process tree (ours: server + gateway; vLLM: API server + EngineCore),
the ratios ours/vLLM.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from e2e_driver import tree_cpu_seconds
from e2e_vs_vllm import engine_args, vllm_env

INPUT_LEN = OUTPUT_LEN = 128
KEYS = ("median_tpot_ms", "median_e2el_ms", "median_ttft_ms", "p99_tpot_ms", "p99_e2el_ms")


def as_flags(kwargs: dict) -> list[str]:
    """LLM(...) keywords as CLI flags: True -> --name, False -> --no-name."""
    out: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        else:
            out += [flag, value if isinstance(value, str) else json.dumps(value)]
    return out


def start_ours(model: str, work: Path, eargs: dict, threads: int | None) -> tuple[list, str]:
    from gateway import start_gateway, start_servers

    flags = as_flags(eargs) + (["--torch-threads", str(threads)] if threads else [])
    [(server, address)] = start_servers(1, model, work, flags)
    try:
        gw, port = start_gateway([address], model, work, "round_robin")
    except BaseException:
        server.kill()
        raise
    return [gw, server], f"http://127.0.0.1:{port}"


def start_vllm(vllm_bin: Path, model: str, work: Path, eargs: dict, env: dict) -> tuple[list, str]:
    from gateway import free_port

    port = free_port()
    log = open(work / "vllm-serve.log", "w")
    cmd = [str(vllm_bin), "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd + as_flags(eargs), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return [proc], url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(
                f"vllm serve did not start:\n{(work / 'vllm-serve.log').read_text()[-4000:]}"
            )
        time.sleep(0.5)


def bench(vllm_bin: Path, url: str, model: str, work: Path, name: str, args) -> dict:
    result = work / f"bench-{name}.json"
    result.unlink(missing_ok=True)
    cmd = [str(vllm_bin), "bench", "serve", "--backend", "openai-chat"]
    cmd += ["--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model]
    cmd += ["--tokenizer", model, "--dataset-name", "random", "--ignore-eos", "--disable-tqdm"]
    cmd += ["--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN)]
    cmd += ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate)]
    cmd += ["--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el"]
    cmd += ["--metric-percentiles", "50,99", "--save-result", "--result-dir", str(work)]
    cmd += ["--result-filename", result.name]
    with open(work / f"bench-{name}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), check=False)
    if not result.exists():
        raise RuntimeError(
            f"vllm bench serve against {name} failed:\n"
            f"{(work / f'bench-{name}.log').read_text()[-4000:]}"
        )
    return json.loads(result.read_text())


def serve_once(engine: str, args, model: str, work: Path, eargs: dict) -> dict:
    vllm_bin = Path(args.vllm_python).parent / "vllm"
    if engine == "ours":
        procs, url = start_ours(model, work, eargs, args.ours_threads)
    else:
        procs, url = start_vllm(vllm_bin, model, work, eargs, vllm_env(json.loads(args.vllm_env)))
    try:
        cpu0 = sum(tree_cpu_seconds(p.pid) for p in procs)
        res = bench(vllm_bin, url, model, work, engine, args)
        cpu = sum(tree_cpu_seconds(p.pid) for p in procs) - cpu0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    out = {k: round(res[k], 3) for k in KEYS}
    out["output_throughput"] = round(res["output_throughput"], 1)
    out["completed"], out["total_output_tokens"] = res["completed"], res["total_output_tokens"]
    out["server_cpu_ms_per_output_token"] = round(
        1000 * cpu / max(1, res["total_output_tokens"]), 3
    )
    return out


def run_serving(args, model: str, work: Path) -> dict:
    engines = [e for e in ("ours", "vllm") if e not in args.skip]
    eargs = {e: engine_args(e, json.loads(getattr(args, f"{e}_args"))) for e in engines}
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for rnd in range(args.rounds):
        for e in engines if rnd % 2 == 0 else engines[::-1]:
            runs[e].append(serve_once(e, args, model, work, eargs[e]))
            print(f"serve round {rnd} {e}: {runs[e][-1]}", flush=True, file=sys.stderr)
    summary = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
    if len(engines) == 2:
        o, v = summary["ours"], summary["vllm"]
        summary["ratio_ours_over_vllm"] = {
            k: round(o[k] / v[k], 3)
            for k in ("median_tpot_ms", "median_e2el_ms", "server_cpu_ms_per_output_token")
        }
    return {
        "serve": {
            "input_len": INPUT_LEN,
            "output_len": OUTPUT_LEN,
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate,
            "rounds": args.rounds,
        },
        "engine_args": eargs,
        "ours_threads": args.ours_threads,
        "vllm_env": json.loads(args.vllm_env),
        "serving": summary,
        "runs": runs,
    }
