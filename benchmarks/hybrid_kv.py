#!/usr/bin/env python3
"""Requests of L tokens held at once in a fixed KV memory, Gemma-2 shaped
(26 layers, half of them with a 4,096-token window): KV cache groups
(core/kv/groups.py; a block costs the bytes of the 13 layers of one group)
against every layer as full attention (a block costs 26 layers).

Each request is prefilled in chunks through the real managers until one
does not fit; prints one JSON line per request length.

    python benchmarks/hybrid_kv.py [--memory-gib 64] [--lengths 8192 32768]

``--step-time`` times the engine steps of one workload (16 requests of
1,024 prompt tokens, 64 output tokens each) through ``tokenbudget.server.LLM``
on a tiny Gemma-2-shaped model, with KV cache groups and without: the same
weights and config but every layer full attention (``layer_types`` all
full; there is no switch that keeps the windows' masks and drops the
groups). Each variant runs in its own fresh process, alternating, for
``--rounds`` rounds; prints one JSON object.

    python benchmarks/hybrid_kv.py --step-time [--rounds 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

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
    ap.add_argument("--step-time", action="store_true", help="time engine steps, groups vs full")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(time_steps(*args.child)))
        return
    if args.step_time:
        print(json.dumps(step_time(args.rounds, args.device)))
        return
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


# -- --step-time ----------------------------------------------------------------
STEP_REQUESTS, STEP_PROMPT, STEP_OUTPUT, STEP_WINDOW = 16, 1024, 64, 256
STEP_MODEL = dict(
    num_hidden_layers=8,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    sliding_window=STEP_WINDOW,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    query_pre_attn_scalar=64,
    max_position_embeddings=4096,
)


def build_models(root: str) -> dict[str, str]:
    """A random tiny Gemma-2 (alternating sliding / full layers) and the same
    weights with every layer full attention."""
    import torch
    import transformers

    from tokenbudget.server.testing.tiny_models import build_tokenizer, padded_vocab_size

    paths = {}
    for name in ("groups", "full"):
        path = os.path.join(root, name)
        tokenizer = build_tokenizer(path)
        config = transformers.Gemma2Config(
            vocab_size=padded_vocab_size(len(tokenizer)),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            bos_token_id=None,
            **STEP_MODEL,
        )
        if name == "full":
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        torch.manual_seed(0)
        transformers.Gemma2ForCausalLM(config).to(torch.float32).save_pretrained(path)
        paths[name] = path
    return paths


def time_steps(model: str, device: str) -> dict:
    """Run the workload once; every engine step timed."""
    import torch

    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    if device == "cpu":
        torch.set_num_threads(1)  # steadier on a shared machine
    blocks_per_request = -(-(STEP_PROMPT + STEP_OUTPUT) // BLOCK) + 1
    llm = LLM(
        model,
        device=device,
        dtype="float32" if device == "cpu" else "bfloat16",
        block_size=BLOCK,
        # Room for every request in every group: no preemption in either run.
        num_gpu_blocks=2 * STEP_REQUESTS * blocks_per_request + 1,
        max_num_seqs=STEP_REQUESTS,
        max_num_batched_tokens=2048,
        max_model_len=STEP_PROMPT + STEP_OUTPUT,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    step, durations = engine.step, []

    def timed():
        t = time.perf_counter()
        out = step()
        durations.append(time.perf_counter() - t)
        return out

    engine.step = timed
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 400 + 20 for j in range(STEP_PROMPT)]}
        for i in range(STEP_REQUESTS)
    ]
    params = SamplingParams(max_tokens=STEP_OUTPUT, temperature=0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    windows = engine.cache_config.kv_group_windows or (0,)
    llm.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == STEP_REQUESTS * STEP_OUTPUT
    return {
        "kv_group_windows": list(windows),
        "steps": len(durations),
        "median_step_ms": 1000 * statistics.median(durations),
        # This process's CPU time (the in-process worker's too): less
        # sensitive than wall time to other load on the machine.
        "cpu_ms_per_step": 1000 * cpu / len(durations),
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "tokens_per_s": (tokens + STEP_REQUESTS * STEP_PROMPT) / wall,
    }


def step_time(rounds: int, device: str) -> dict:
    """Both variants in fresh processes, alternating which goes first."""
    runs: dict[str, list[dict]] = {"groups": [], "full": []}
    with tempfile.TemporaryDirectory() as root:
        paths = build_models(root)
        for r in range(rounds):
            for name in ("groups", "full") if r % 2 == 0 else ("full", "groups"):
                cmd = [sys.executable, __file__, "--child", paths[name], device]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))

    def summary(name: str) -> dict:
        rs = runs[name]
        return {
            "kv_group_windows": rs[0]["kv_group_windows"],
            "steps": rs[0]["steps"],
            "median_step_ms": round(statistics.median(r["median_step_ms"] for r in rs), 3),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
            "output_tokens_per_s": round(
                statistics.median(r["output_tokens_per_s"] for r in rs), 1
            ),
            "cpu_ms_per_step": round(statistics.median(r["cpu_ms_per_step"] for r in rs), 3),
            # The least contended round: on a shared machine, the cost itself.
            "best_round_step_ms": round(min(r["median_step_ms"] for r in rs), 3),
            "rounds_median_step_ms": [round(r["median_step_ms"], 3) for r in rs],
        }

    groups, full = summary("groups"), summary("full")
    return {
        "bench": "hybrid_kv_step_time",
        "device": device,
        "workload": f"{STEP_REQUESTS} x {STEP_PROMPT} prompt -> {STEP_OUTPUT} tokens",
        "model": dict(STEP_MODEL, arch="Gemma2ForCausalLM", layers="alternating sliding/full"),
        "without_groups": "same weights, layer_types all full_attention (one KV group)",
        "groups": groups,
        "full": full,
        "step_time_ratio": round(groups["median_step_ms"] / full["median_step_ms"], 3),
        "tokens_per_s_ratio": round(groups["tokens_per_s"] / full["tokens_per_s"], 3),
        "cpu_time_per_step_ratio": round(groups["cpu_ms_per_step"] / full["cpu_ms_per_step"], 3),
        "best_round_step_time_ratio": round(
            groups["best_round_step_ms"] / full["best_round_step_ms"], 3
        ),
    }


if __name__ == "__main__":
    main()
