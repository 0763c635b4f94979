"""Mixed load through the SGLang gateway: two colocated replicas against one
prefill + one decode server (issue 28), same tiny checkpoint, same requests.

    python benchmarks/disagg_mixed.py --out mixed.json --png mixed.png

The load: ``--decoders`` closed-loop clients each asking short prompts for
``--decode-tokens`` tokens (they measure time per output token), while long
prompts (``--long-words`` words, 16 tokens out) arrive every ``--long-every``
seconds. Reported per setup: TPOT p50/p99 of the short requests (mean gap
between their streamed tokens, per request), TTFT p50/p99 of the long ones
and of the short ones, and errors.

On this 2-core CPU machine every server shares the same two cores, so this
shows the mechanism (a long prefill no longer runs in the decode's steps),
not what separate GPUs would give; read the figures as such.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway import WORDS, free_port, start_gateway_argv, start_servers, stop  # noqa: E402


def stream(port: int, text: str, max_tokens: int, model: str) -> tuple[float, list[float]]:
    """(TTFT s, the arrival times of the streamed tokens) of one /generate."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {
        "model": model,
        "text": text,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times: list[float] = []
    for line in r:
        if line.startswith(b'data: {"error'):
            raise RuntimeError(line.decode(errors="replace"))
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            ids = json.loads(line[6:]).get("output_ids") or []
            times += [time.perf_counter() - t0] * max(1, len(ids) - len(times))
    conn.close()
    if not times:
        raise RuntimeError("no token streamed")
    return times[0], times


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 2)


def run_load(port: int, model: str, args) -> dict:
    rng = random.Random(0)
    stop_at = time.perf_counter() + args.seconds
    short, long_, errors = [], [], []
    lock = threading.Lock()

    def decoder(seed: int) -> None:
        r = random.Random(seed)
        while time.perf_counter() < stop_at:
            text = " ".join(r.choice(WORDS) for _ in range(24))
            try:
                res = stream(port, text, args.decode_tokens, model)
            except Exception as exc:  # counted: a benchmark must not hide failures
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                short.append(res)

    def long_one(text: str) -> None:
        try:
            res = stream(port, text, 16, model)
        except Exception as exc:
            with lock:
                errors.append(str(exc))
            return
        with lock:
            long_.append(res)

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(args.decoders)]
    for t in threads:
        t.start()
    while time.perf_counter() < stop_at:
        text = " ".join(rng.choice(WORDS) for _ in range(args.long_words))
        t = threading.Thread(target=long_one, args=(text,))
        t.start()
        threads.append(t)
        time.sleep(args.long_every)
    for t in threads:
        t.join()
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for _, ts in short if len(ts) > 1]
    return {
        "short_requests": len(short),
        "long_requests": len(long_),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "short_tpot_p50_ms": pct(tpots, 0.5),
        "short_tpot_p99_ms": pct(tpots, 0.99),
        "short_ttft_p50_ms": pct([r[0] for r in short], 0.5),
        "long_ttft_p50_ms": pct([r[0] for r in long_], 0.5),
        "long_ttft_p99_ms": pct([r[0] for r in long_], 0.99),
    }


def setup(kind: str, model: str, work: Path, extra: list[str]):
    """Servers and the gateway for ``kind``: colocated (2 replicas) or pd (1 + 1)."""
    if kind == "colocated":
        servers = start_servers(2, model, work, extra)
        routing = ["--worker-urls", *(f"grpc://{a}" for _, a in servers)]
    else:
        bport = free_port()
        pre = start_servers(
            1, model, work, [*extra, "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", str(bport)]
        )  # fmt: skip
        dec = start_servers(1, model, work, [*extra, "--disaggregation-mode", "decode"])
        servers = pre + dec
        routing = [
            "--pd-disaggregation",
            "--prefill", f"grpc://{pre[0][1]}", str(bport),
            "--decode", f"grpc://{dec[0][1]}",
        ]  # fmt: skip
    gateway, port = start_gateway_argv(routing, len(servers), model, work, "random")
    return [p for p, _ in servers] + [gateway], port


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["short_tpot_p50_ms", "short_tpot_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms"]
    kinds = list(result["setups"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        ys = [result["setups"][kind][k] for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], ys, width, label=kind)
    ax.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(keys))], keys, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title("tiny model, 2 CPU cores shared by every process: the mechanism only")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny Qwen3)")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--long-words", type=int, default=1500)
    p.add_argument("--long-every", type=float, default=1.0)
    p.add_argument("--setups", nargs="+", default=["colocated", "pd"], choices=["colocated", "pd"])
    p.add_argument("--out", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    extra = ["--num-gpu-blocks", "2048", "--max-model-len", "4096"]
    result = {"load": vars(args), "setups": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

            model = build_tiny_qwen3(work / "model")
        for kind in args.setups:
            procs, port = setup(kind, model, work, extra)
            try:
                stream(port, "warm up", 4, model)
                result["setups"][kind] = run_load(port, model, args)
            finally:
                stop(procs)
            print(kind, json.dumps(result["setups"][kind]), file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.png:
        plot(result, args.png)


if __name__ == "__main__":
    main()
