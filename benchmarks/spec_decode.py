"""Speculative decoding with the n-gram proposer: engine steps per output token and
tokens/s, with and without drafts, measured side by side on the same workloads.

    python benchmarks/spec_decode.py                  # tiny models built locally, CPU
    python benchmarks/spec_decode.py --repeats 5 --num-prompts 16 --device cuda

Workloads (one JSON line each, then a summary line):

* ``copy``: outputs repeat their prompts. The model is a tiny Qwen3 with hand-set
  weights whose greedy rule is a fixed permutation of the tokens: attention and MLP
  outputs are zeroed, so the last hidden state is the current token's embedding, and
  the LM head holds each token's embedding in the row of its successor (random
  256-dimensional embeddings are nearly orthogonal, so the successor wins the argmax).
  The permutation is one cycle over CYCLE tokens; a prompt is CYCLE + 20 consecutive
  tokens of that cycle, so the greedy continuation repeats the prompt verbatim. The
  forward still computes every layer (zeroed weights cost the same FLOPs). This is
  the best case for prompt lookup: every draft is right once the cycle is seen.
* ``non-copy``: a random tiny Qwen3 of the same shape sampling at temperature 1 (seeded)
  from random prompts: the text does not repeat, so drafts are rare and mostly
  rejected; what is measured is the proposer's and the verification's overhead.
* ``random-greedy``: the same random model, greedy. Random tiny models' greedy output
  drifts into loops at varying points, so this sits in between (reported as measured).

Each configuration runs ``--repeats`` times, interleaved; tokens/s is the median
(and the best run), and tokens per CPU-second of this process is reported too: on a
machine shared with other work, wall time swings by tens of percent between
identical runs, CPU time much less.
Configurations: with drafts (async scheduling, the default: steps overlap while
no drafts are proposed) and, as baselines, the engine without drafts, async (the
default) and synchronous; the async baseline is built twice, and ``noise_floor``
(one over the other) shows how far two identical engines differ in that run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
)
FIRST_TOKEN = 16  # past the tiny tokenizer's special tokens
CYCLE = 200


def build_models(root: Path) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    random_path = build_tiny_qwen3(root / "random", seed=0, **SHAPE)
    copy_path = build_tiny_qwen3(root / "copy", seed=1, **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(copy_path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.randn_like(model.model.embed_tokens.weight)
        model.model.embed_tokens.weight.copy_(emb)
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros_like(model.lm_head.weight)
        cycle = torch.arange(FIRST_TOKEN, FIRST_TOKEN + CYCLE)
        successor = torch.roll(cycle, -1)
        head[successor] = emb[cycle]  # logit(successor(x)) = <e_x, e_x>: the largest
        model.lm_head.weight.copy_(head)
    model.save_pretrained(copy_path)
    return copy_path, random_path


def workloads(args, copy_path: str, random_path: str):
    from tokenbudget.core import SamplingParams

    rng = np.random.default_rng(0)
    starts = rng.integers(0, CYCLE, size=args.num_prompts)
    copy_prompts = [[FIRST_TOKEN + (int(s) + i) % CYCLE for i in range(CYCLE + 20)] for s in starts]
    random_prompts = [
        rng.integers(FIRST_TOKEN, 1000, size=CYCLE + 20).tolist() for _ in range(args.num_prompts)
    ]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    sampled = [
        SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(args.num_prompts)
    ]
    return {
        "copy": (copy_path, copy_prompts, greedy),
        "non-copy": (random_path, random_prompts, sampled),
        "random-greedy": (random_path, random_prompts, greedy),
    }


def make_llm(args, path: str, spec: dict | None, async_scheduling: bool):
    from tokenbudget.server import LLM

    return LLM(
        path,
        dtype=args.dtype,
        device=args.device,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=max(args.num_prompts, 1),
        speculative_config=spec,
        async_scheduling=async_scheduling,
    )


def run_once(llm, prompts, params) -> dict:
    engine = llm.engine
    runner = llm.executor.worker.model_runner
    counts = {"steps": 0}
    execute = llm.executor.execute_model

    def counting(so):
        if so.total_num_scheduled_tokens:
            counts["steps"] += 1
        return execute(so)

    engine.executor.execute_model = counting
    runner.timings.clear()
    before = engine.stats().spec_decoding
    t0, c0 = time.perf_counter(), time.process_time()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    engine.executor.execute_model = execute
    after = engine.stats().spec_decoding
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": tokens,
        "steps": counts["steps"],
        "propose_s": runner.timings.get("propose", 0.0),
        "drafts": after.num_drafts - before.num_drafts,
        "draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
        "accepted": after.num_accepted_tokens - before.num_accepted_tokens,
        "token_ids": [r.token_ids for r in results],
    }


def bench(args, name: str, path: str, prompts, params, spec: dict) -> dict:
    # base_again is base built twice: its ratio to base is the run's noise floor, the
    # yardstick for a small difference such as drafts' overhead where none are found.
    configs = {
        "spec": (spec, True),
        "base": (None, True),
        "base_again": (None, True),
        "spec_sync": (spec, False),
        "base_sync": (None, False),
    }
    llms = {k: make_llm(args, path, s, a) for k, (s, a) in configs.items()}
    for llm in llms.values():  # warm up
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]],
            params if not isinstance(params, list) else params[:2],
        )
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for _ in range(args.repeats):
        for k, llm in llms.items():
            runs[k].append(run_once(llm, prompts, params))
    # Same tokens with and without drafts (greedy, and seeded sampling).
    same = all(runs[k][0]["token_ids"] == runs["base"][0]["token_ids"] for k in configs)

    def summary(k: str) -> dict:
        r = runs[k]
        tps = [x["tokens"] / x["wall_s"] for x in r]
        steps = r[0]["steps"]
        out = {
            "tokens_per_s": round(statistics.median(tps), 1),
            "tokens_per_s_best": round(max(tps), 1),
            # CPU time of this process: less disturbed by other load on the machine.
            "tokens_per_cpu_s": round(statistics.median(x["tokens"] / x["cpu_s"] for x in r), 1),
            "steps": steps,
            # Engine steps per output token of one sequence (all run together).
            "steps_per_output_token": round(steps * args.num_prompts / r[0]["tokens"], 4),
        }
        if k.startswith("spec"):
            x = r[0]
            out.update(
                {
                    "drafts": x["drafts"],
                    "draft_tokens": x["draft_tokens"],
                    "accepted_tokens": x["accepted"],
                    "acceptance_rate": round(x["accepted"] / x["draft_tokens"], 4)
                    if x["draft_tokens"]
                    else 0.0,
                    "mean_accepted_length": round(1 + x["accepted"] / x["drafts"], 3)
                    if x["drafts"]
                    else 0.0,
                    "propose_us_per_step": round(
                        statistics.median(y["propose_s"] / y["steps"] for y in r) * 1e6, 1
                    ),
                    # The proposer's share of the wall time: what drafts cost where none
                    # are found (steadier than a tokens/s ratio on a shared machine).
                    "propose_share_of_wall": round(
                        statistics.median(y["propose_s"] / y["wall_s"] for y in r), 4
                    ),
                }
            )
        return out

    res = {k: summary(k) for k in configs}
    return {
        "workload": name,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "speculative_config": spec,
        "same_tokens_as_without_drafts": same,
        **res,
        # Drafts against none, both at the default (async) and both synchronous.
        "step_reduction": round(res["base"]["steps"] / res["spec"]["steps"], 3),
        "sync_step_reduction": round(res["base_sync"]["steps"] / res["spec_sync"]["steps"], 3),
        "speedup": round(res["spec"]["tokens_per_s"] / res["base"]["tokens_per_s"], 3),
        "noise_floor": round(res["base_again"]["tokens_per_s"] / res["base"]["tokens_per_s"], 3),
        "best_speedup": round(
            res["spec"]["tokens_per_s_best"] / res["base"]["tokens_per_s_best"], 3
        ),
        "cpu_speedup": round(res["spec"]["tokens_per_cpu_s"] / res["base"]["tokens_per_cpu_s"], 3),
        "sync_speedup": round(
            res["spec_sync"]["tokens_per_s"] / res["base_sync"]["tokens_per_s"], 3
        ),
        "sync_cpu_speedup": round(
            res["spec_sync"]["tokens_per_cpu_s"] / res["base_sync"]["tokens_per_cpu_s"], 3
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-gpu-blocks", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workloads", default="copy,non-copy,random-greedy")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    with tempfile.TemporaryDirectory() as tmp:
        copy_path, random_path = build_models(Path(tmp))
        cases = workloads(args, copy_path, random_path)
        results = []
        for name in args.workloads.split(","):
            path, prompts, params = cases[name]
            r = bench(args, name, path, prompts, params, spec)
            results.append(r)
            print(json.dumps(r), flush=True)
    keys = (
        "step_reduction",
        "speedup",
        "best_speedup",
        "cpu_speedup",
        "noise_floor",
        "sync_step_reduction",
        "sync_speedup",
        "sync_cpu_speedup",
    )
    print(
        json.dumps(
            {
                "summary": {r["workload"]: {k: r[k] for k in keys} for r in results},
                "device": args.device,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
