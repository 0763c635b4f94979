"""Per-layer paged attention on CPU: the ``sdpa`` backend (gather each request's
blocks, then torch SDPA) against ``cpu`` (our C++ kernel reading the blocks in
place, worker/csrc/paged_attention_cpu.cpp).

    python benchmarks/attention_cpu.py                  # both shapes, all cases
    python benchmarks/attention_cpu.py --threads 1 --dtype bfloat16

One layer's call of ``paged_attention_forward`` (the KV write at slot_mapping
included, which both pay alike) is timed; the step's metadata is built once,
outside the timing, as the runner shares it across layers. Decode batches have
every request at the same context; block tables are shuffled blocks. Prints
one JSON object: median wall milliseconds per layer for each backend, their
ratio, and the ratio of CPU time (process time, all threads: on a shared
machine the steadier of the two).
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

from tokenbudget.worker.attention import allocate_kv_caches, build_metadata, paged_attention_forward
from tokenbudget.worker.attention_cpu import cpu_kernel_problem

SHAPES = {"tiny": (4, 2, 64), "qwen3-0.6b": (16, 8, 128)}  # H, Hkv, D


def make_case(rng, H, Hkv, D, query_lens, seq_lens, block_size, dtype):
    query_lens, seq_lens = np.asarray(query_lens), np.asarray(seq_lens)
    blocks = -(-seq_lens // block_size)
    num_blocks = int(blocks.sum()) + 1
    (cache,) = allocate_kv_caches(1, num_blocks, block_size, Hkv, D, dtype, torch.device("cpu"))
    cache.normal_()
    free = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(seq_lens), int(blocks.max())), dtype=np.int32)
    ends = np.cumsum(blocks)
    for i, n in enumerate(blocks):
        tables[i, :n] = free[ends[i] - n : ends[i]]
    positions = np.concatenate([np.arange(L - q, L) for q, L in zip(query_lens, seq_lens)])
    rows = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = tables[rows, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    T = int(query_lens.sum())
    return SimpleNamespace(
        cache=cache,
        args=(query_lens, seq_lens, tables, slots),
        q=torch.randn(1, H, T, D, dtype=dtype),
        k=torch.randn(1, Hkv, T, D, dtype=dtype),
        v=torch.randn(1, Hkv, T, D, dtype=dtype),
        block_size=block_size,
    )


def time_layer(backend: str, case, min_seconds: float) -> tuple[float, float]:
    """Median wall and CPU (all threads) milliseconds of one layer's paged_attention_forward."""
    meta = build_metadata(
        backend, [case.cache], case.block_size, *case.args, device=torch.device("cpu")
    )
    module = SimpleNamespace(layer_idx=0)
    D = case.q.shape[-1]

    def call():
        paged_attention_forward(
            module, case.q, case.k, case.v, None, scaling=D**-0.5, paged_attn=meta
        )

    call()  # warm-up
    wall, cpu, start = [], [], time.perf_counter()
    while len(wall) < 3 or (time.perf_counter() - start < min_seconds and len(wall) < 200):
        t, c = time.perf_counter(), time.process_time()
        call()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return float(np.median(wall)) * 1e3, float(np.median(cpu)) * 1e3


def cases(decode_batches, contexts, prefill):
    for B in decode_batches:
        for L in contexts:
            yield f"decode B={B} ctx={L}", [1] * B, [L] * B
    q, L = prefill
    yield f"prefill chunk q={q} ctx={L}", [q], [L]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 640, 2048])
    p.add_argument("--prefill", type=int, nargs=2, default=(512, 1024), metavar=("Q", "CTX"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--min-seconds", type=float, default=0.5, help="per case and backend")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    problem = cpu_kernel_problem()
    if problem:
        raise SystemExit(f"the cpu backend cannot run here: {problem}")
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    report = {
        "dtype": args.dtype,
        "block_size": args.block_size,
        "threads": torch.get_num_threads(),
        "unit": "median wall ms per layer; the CPU-time ratio counts every thread's time",
        "results": {},
    }
    for shape in args.shapes:
        H, Hkv, D = SHAPES[shape]
        rows = report["results"][f"{shape} H={H} Hkv={Hkv} D={D}"] = {}
        for name, query_lens, seq_lens in cases(args.batches, args.contexts, args.prefill):
            case = make_case(rng, H, Hkv, D, query_lens, seq_lens, args.block_size, dtype)
            (sdpa, sdpa_cpu), (ours, ours_cpu) = (
                time_layer(backend, case, args.min_seconds) for backend in ("sdpa", "cpu")
            )
            rows[name] = {
                "sdpa_ms": round(sdpa, 3),
                "cpu_ms": round(ours, 3),
                "sdpa/cpu": round(sdpa / ours, 2),
                "sdpa/cpu (CPU time)": round(sdpa_cpu / ours_cpu, 2),
            }
            del case
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
