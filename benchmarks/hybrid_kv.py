#!/usr/bin/env python3
"""Requests of L tokens held at once in a fixed KV memory, Gemma-2 shaped
(26 layers, half of them with a 4,096-token window): KV cache groups
(core/kv/groups.py; a block costs the bytes of the 13 layers of one group)
against every layer as full attention (a block costs 26 layers).

Each request is prefilled in chunks through the real managers until one
does not fit; prints one JSON line per request length.

    python benchmarks/hybrid_kv.py [--memory-gib 64] [--lengths 8192 32768]
"""

from __future__ import annotations

import argparse
import json

from tokenbudget.core import Request, SamplingParams
from tokenbudget.core.kv import KVCacheManager
from tokenbudget.core.kv.groups import HybridKVCacheManager

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 26, 4, 256, 2  # Gemma-2-2B
WINDOW, BLOCK, CHUNK = 4096, 16, 512


def block_bytes(layers: int) -> int:
    return 2 * layers * BLOCK * KV_HEADS * HEAD_DIM * DTYPE_BYTES


def held_requests(kv: KVCacheManager, length: int) -> int:
    """Requests of ``length`` tokens prefilled one after another until one fails."""
    n = 0
    while True:
        req = Request(f"r{n}", [n % 1000 + 1] * length, SamplingParams(max_tokens=1))
        while req.num_computed_tokens < length:
            step = min(CHUNK, length - req.num_computed_tokens)
            if kv.allocate_slots(req, step) is None:
                return n
            req.num_computed_tokens += step
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-gib", type=float, default=64.0)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    args = ap.parse_args()
    memory = int(args.memory_gib * (1 << 30))
    for length in args.lengths:
        full_blocks = memory // block_bytes(LAYERS)
        group_blocks = memory // block_bytes(LAYERS // 2)
        full = held_requests(KVCacheManager(full_blocks, BLOCK, enable_caching=False), length)
        groups = held_requests(
            HybridKVCacheManager(group_blocks, BLOCK, (0, WINDOW), enable_caching=False), length
        )
        print(
            json.dumps(
                {
                    "bench": "hybrid_kv",
                    "request_tokens": length,
                    "kv_memory_gib": args.memory_gib,
                    "all_full_requests": full,
                    "groups_requests": groups,
                    "ratio": round(groups / full, 3) if full else None,
                    # Bound for half full / half windowed layers: 2L / (L + W).
                    "ideal_ratio": round(2 * length / (length + WINDOW), 3),
                }
            )
        )


if __name__ == "__main__":
    main()
