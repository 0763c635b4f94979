"""Decode-step attention timing: the triton backend (reads the paged cache in
place) against SDPA with a gather of each request's blocks (the reference
backend), on one layer's cache. ``benchmarks/gpu_check.py`` calls
``benchmark_decode``; on CPU it runs with tiny shapes under
``TRITON_INTERPRET=1`` (slow: a check that the code path works, not a timing).

    python -m tokenbudget.worker.attention_bench --context-len 4096 --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from tokenbudget.worker.attention import _sdpa_attention, build_metadata, paged_kernel


def _paged_decode_batch(
    batch_size: int,
    context_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
):
    """(q [B, H, D], cache [2, num_blocks, block_size, Hkv, D], per-backend
    metadata): every request has ``context_len`` tokens in shuffled blocks."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    per_req = -(-context_len // block_size)
    num_blocks = batch_size * per_req + 1  # block 0 is the null block
    cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device
    ).to(dtype)
    q = torch.randn(batch_size, num_heads, head_dim, generator=gen, device=device).to(dtype)
    tables = rng.permutation(np.arange(1, num_blocks)).reshape(batch_size, per_req)
    query_lens = np.ones(batch_size, dtype=np.int64)
    seq_lens = np.full(batch_size, context_len, dtype=np.int64)
    slots = np.zeros(batch_size, dtype=np.int64)  # unused: nothing is written

    def meta(backend: str):
        return build_metadata(
            backend, [cache], block_size, query_lens, seq_lens, tables, slots, device
        )

    return q, cache, {"triton": meta("triton"), "sdpa": meta("sdpa")}


def _seconds_per_call(fn, device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def benchmark_decode(
    *,
    batch_size: int = 64,
    context_len: int = 4096,
    num_heads: int = 16,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    iters: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> dict:
    """One decode step's attention for one layer (defaults: Qwen3-0.6B's
    heads, bf16): ms per call of the triton kernel and of SDPA-with-gather,
    the speedup, the largest difference between their outputs, and the KV
    bytes the step must read over the triton time (GB/s, to compare with the
    device's bandwidth). On CPU the triton kernel needs TRITON_INTERPRET=1."""
    device = torch.device(device)
    q, cache, metas = _paged_decode_batch(
        batch_size, context_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed
    )
    scale = head_dim**-0.5
    kernel = paged_kernel("triton")

    def triton_step():
        return kernel(q, cache[0], cache[1], metas["triton"], scale)

    def sdpa_step():
        return _sdpa_attention(q, cache, metas["sdpa"], scale)

    diff = (triton_step().float() - sdpa_step().float()).abs().max().item()
    triton_s = _seconds_per_call(triton_step, device, iters, warmup)
    sdpa_s = _seconds_per_call(sdpa_step, device, iters, warmup)
    kv_bytes = 2 * batch_size * context_len * num_kv_heads * head_dim * cache.element_size()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch_size": batch_size,
        "context_len": context_len,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": str(dtype).removeprefix("torch."),
        "triton_ms": triton_s * 1e3,
        "sdpa_gather_ms": sdpa_s * 1e3,
        "speedup": sdpa_s / triton_s,
        "max_abs_diff": diff,
        "triton_kv_gb_per_s": kv_bytes / triton_s / 1e9,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    result = benchmark_decode(
        batch_size=args.batch_size,
        context_len=args.context_len,
        block_size=args.block_size,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        iters=args.iters,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
