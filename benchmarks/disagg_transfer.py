"""KV transfer between two processes on this machine, as disaggregated
prefill/decode moves it (issue 28): the prefill's worker writes a request's
blocks into the decode's cache with NIXL (worker/kv_transfer_nixl.py, UCX)
or Mooncake (worker/kv_transfer_mooncake.py, its ``tcp`` protocol).

    python benchmarks/disagg_transfer.py                      # both backends, both shapes
    python benchmarks/disagg_transfer.py --shapes tiny --backends nixl mooncake \
        --repeats 50 --out t.json --png t.png

The decode side is a second process (spawned) holding its own KV cache,
registered with its own NIXL agent or Mooncake engine; the handshake bytes
cross a pipe, as they cross the bootstrap gRPC call in the server. Every
backend gets the same shapes, sizes and layouts. For each request size (1, 16,
256 blocks) and block layout (``contiguous``: the decode's blocks are one run,
one descriptor per layer and K/V half; ``scattered``: every block its own
run) it times ``start`` until ``poll`` reports the send finished, and checks
the bytes landed (the first and last block, every layer).

``--prefill-ms`` also times our prefill of as many tokens on the tiny
checkpoint through ``LLM`` (max_tokens=1; distinct prompts, so no prefix
hits), so the JSON gives the share of a TTFT that the transfer would be
(transfer / (prefill + transfer)).

Mooncake's wheel (mooncake-transfer-engine-non-cuda) loads the system's
libibverbs1 and moves host memory only. It submits one batch per descriptor
(see its module), so the ``scattered`` layout shows its per-descriptor cost.
Prints one JSON object (and writes a PNG with --png): median milliseconds and
GB/s per backend, shape, size and layout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

# (layers, kv heads, head_dim, dtype): the e2e benchmark's tiny Qwen3 and Qwen3-0.6B's KV.
SHAPES = {"tiny": (4, 2, 64, torch.float32), "qwen3-0.6b": (28, 8, 128, torch.bfloat16)}
SIZES = (1, 16, 256)
BLOCK_SIZE = 16


def _caches(shape: str, num_blocks: int, fill: float | None) -> list[torch.Tensor]:
    layers, heads, dim, dtype = SHAPES[shape]
    caches = [
        torch.zeros(2, num_blocks, BLOCK_SIZE, heads, dim, dtype=dtype) for _ in range(layers)
    ]
    if fill is None:
        for i, c in enumerate(caches):
            c.copy_(torch.arange(c.numel(), dtype=torch.float32).view_as(c) % 251 + i)
    return caches


BACKENDS = {"nixl": "NIXL (UCX)", "mooncake": "Mooncake (tcp)"}


def _transfer(backend: str, caches: list[torch.Tensor]):
    """The worker side of ``backend`` on these caches (both ends on loopback)."""
    if backend == "mooncake":
        from tokenbudget.worker.kv_transfer_mooncake import MooncakeKVTransfer

        return MooncakeKVTransfer(caches, 0, BLOCK_SIZE, hostname="127.0.0.1")
    from tokenbudget.worker.kv_transfer_nixl import NixlKVTransfer

    return NixlKVTransfer(caches, 0, BLOCK_SIZE)


def _decode_side(backend: str, shape: str, num_blocks: int, conn) -> None:
    torch.set_num_threads(1)
    caches = _caches(shape, num_blocks, 0.0)
    xfer = _transfer(backend, caches)
    conn.send(xfer.handshake())
    while True:
        msg = conn.recv()
        if msg is None:
            break
        # Check request: the given blocks' bytes, every layer, K and V.
        conn.send([c[:, msg].float().sum().item() for c in caches])
    xfer.close()


def _time_sends(xfer, handshake, num_blocks, size, layout, repeats, conn, src_caches):
    from tokenbudget.core.kv.connector import KVConnectorMetadata, KVSend

    src = list(range(1, size + 1))
    if layout == "contiguous":
        dst = list(range(num_blocks - size, num_blocks))
    else:  # every other block: no two consecutive, one descriptor per block
        dst = list(range(num_blocks - 2 * size + 1, num_blocks, 2))
    times = []
    for i in range(repeats):
        rid = f"{size}-{layout}-{i}"
        t0 = time.perf_counter()
        xfer.start(KVConnectorMetadata(sends=[KVSend(rid, src, dst, [handshake])]))
        while True:
            finished, failed = xfer.poll()
            if failed:
                raise RuntimeError(f"send failed: {failed}")
            if rid in finished:
                break
        times.append(time.perf_counter() - t0)
    # The bytes landed: compare sums of the first and last block on both sides.
    for s, d in ((src[0], dst[0]), (src[-1], dst[-1])):
        conn.send(d)
        theirs = conn.recv()
        ours = [c[:, s].float().sum().item() for c in src_caches]
        if theirs != ours:
            raise RuntimeError(f"block {s} -> {d} differs after the transfer")
    return statistics.median(times)


def run_shape(backend: str, shape: str, repeats: int) -> dict:
    num_blocks = 2 * max(SIZES) + 2
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(backend, shape, num_blocks, child), daemon=True)
    proc.start()
    caches = _caches(shape, num_blocks, None)
    xfer = _transfer(backend, caches)
    handshake = parent.recv()
    per_block = sum(c[:, 0].numel() * c.element_size() for c in caches)
    results = {"bytes_per_block": per_block}
    try:
        for layout in ("contiguous", "scattered"):
            for size in SIZES:
                _time_sends(xfer, handshake, num_blocks, size, layout, 2, parent, caches)  # warm
                sec = _time_sends(
                    xfer, handshake, num_blocks, size, layout, repeats, parent, caches
                )
                results[f"{layout} {size} blocks"] = {
                    "ms": round(sec * 1e3, 3),
                    "GB_per_s": round(size * per_block / sec / 1e9, 3),
                }
    finally:
        parent.send(None)
        proc.join(30)
        xfer.close()
    return results


def prefill_ms(sizes) -> dict:
    """Our prefill of ``size`` blocks' tokens (max_tokens=1) on the tiny checkpoint."""
    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_qwen3(tmp, max_position_embeddings=8192)
        llm = LLM(path, dtype="float32", num_gpu_blocks=2 * max(sizes) + 8, max_model_len=8192)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        for size in sizes:
            for first in (3, 4):  # a warm-up, then the timed one: no prefix in common
                prompt = {"prompt_token_ids": [first] + [7 + i % 50 for i in range(size * 16 - 1)]}
                t0 = time.perf_counter()
                llm.generate(prompt, sp)
                out[size] = (time.perf_counter() - t0) * 1e3
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    markers = dict(zip(SHAPES, "os^"))
    for color, (backend, runs) in zip(("C0", "C3", "C2"), result["backends"].items()):
        for shape, rows in runs["shapes"].items():
            for layout, style in (("contiguous", "-"), ("scattered", "--")):
                ys = [rows[f"{layout} {n} blocks"]["GB_per_s"] for n in SIZES]
                label = f"{runs['name']}, {shape}, {layout}"
                ax.plot(SIZES, ys, style, color=color, marker=markers[shape], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("blocks per request (16 tokens each)")
    ax.set_ylabel("GB/s (KV WRITE, two processes, one host)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ttft_share(rows: dict, pre: dict) -> dict:
    """The share of a TTFT (prefill + transfer) that the transfer takes."""
    out = {}
    for n in SIZES:
        ms = rows[f"contiguous {n} blocks"]["ms"]
        out[f"{n} blocks"] = {
            "prefill_ms": round(pre[n], 2),
            "transfer_ms": ms,
            "transfer_share": round(ms / (pre[n] + ms), 3),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--prefill-ms", action="store_true", help="also time our prefill (tiny)")
    p.add_argument("--out", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {"block_size": BLOCK_SIZE, "backends": {}}
    for backend in args.backends:
        runs = {"name": BACKENDS[backend], "shapes": {}}
        for shape in args.shapes:
            runs["shapes"][shape] = run_shape(backend, shape, args.repeats)
        result["backends"][backend] = runs
    if args.prefill_ms and "tiny" in args.shapes:
        pre = prefill_ms(SIZES)
        for runs in result["backends"].values():
            runs["tiny_ttft_share"] = ttft_share(runs["shapes"]["tiny"], pre)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.png:
        plot(result, args.png)


if __name__ == "__main__":
    main()
