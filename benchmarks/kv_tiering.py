"""The host KV tier against recompute, on two workloads (CPU by default).

    python benchmarks/kv_tiering.py                      # a small random Qwen3 built locally
    python benchmarks/kv_tiering.py --model PATH --device cuda

* ``pressure``: every request at once, the device KV sized for a quarter of
  their total demand, so running requests are preempted again and again.
  Recompute (no host tier) against swap (a host tier with room): tokens the
  forward computed (prompt + output tokens are the useful part; the rest is
  recomputation), preemptions, blocks copied, end-to-end time. Both runs must
  produce the same greedy tokens.
* ``chat``: multi-turn conversations served one turn at a time, round robin,
  whose histories together are 4x the device KV: each turn's prompt is the
  whole conversation so far. Without a host tier most of a returning
  conversation's prefix was evicted; with it the prefix is loaded back.
  Prefix hit rate (tokens) and TTFT (mean, p50, p90) for both.

Prints one JSON line per workload. Time is wall time of this machine; on CPU
``cpu_s`` (this process's CPU time) also counts, and is steadier than wall
time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch


def build_model(args) -> str:
    if args.model:
        return args.model
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    path = tempfile.mkdtemp(prefix="kv_tiering_model_")
    return build_tiny_qwen3(
        path,
        seed=0,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=3 * args.hidden_size,
        head_dim=args.hidden_size // 8,
    )


def make_llm(args, model: str, num_gpu_blocks: int, num_offload_blocks: int, max_model_len: int):
    from tokenbudget.server import LLM

    return LLM(
        model,
        dtype=args.dtype,
        device=args.device,
        num_gpu_blocks=num_gpu_blocks,
        num_offload_blocks=num_offload_blocks or None,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.async_scheduling,
        max_model_len=max_model_len,
    )


class ForwardCounter:
    """Wraps the executor's execute_model, summing the tokens each step sends."""

    def __init__(self, executor) -> None:
        self.tokens = 0
        self.steps = 0
        self._execute = executor.execute_model
        executor.execute_model = self

    def __call__(self, scheduler_output):
        self.tokens += scheduler_output.total_num_scheduled_tokens
        self.steps += not scheduler_output.is_empty
        return self._execute(scheduler_output)


def pressure(args, model: str) -> dict:
    from tokenbudget.core import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(16, 1000, size=args.prompt_len).tolist() for _ in range(args.num_requests)
    ]
    demand_blocks = args.num_requests * -(-(args.prompt_len + args.output_len) // args.block_size)
    device_blocks = demand_blocks // 4 + 1
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    out = {
        "workload": "pressure",
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "device_blocks": device_blocks - 1,
        "demand_blocks": demand_blocks,
        # A request's last sampled token is never fed back: prompt + output - 1.
        "useful_tokens": args.num_requests * (args.prompt_len + args.output_len - 1),
    }
    tokens, elapsed, cpu = {}, {"recompute": [], "swap": []}, {"recompute": [], "swap": []}
    # Alternate the two configurations and keep each one's best time: the
    # machine may be shared.
    for _ in range(args.repeat):
        for name, host in (("recompute", 0), ("swap", 2 * demand_blocks)):
            llm = make_llm(args, model, device_blocks, host, args.prompt_len + args.output_len)
            counter = ForwardCounter(llm.executor)
            timings = llm.executor.worker.model_runner.timings
            t0, c0 = time.perf_counter(), time.process_time()
            results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            elapsed[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            forward_s = timings["forward"]
            stats = llm.engine.stats()
            llm.shutdown()
            tokens[name] = [r.token_ids for r in results]
            out[name] = {
                "forward_tokens": counter.tokens,
                "e2e_s": round(min(elapsed[name]), 3),
                "cpu_s": round(min(cpu[name]), 3),
                "steps": counter.steps,
                "forward_s_last": round(forward_s, 3),
                "preemptions": stats.num_preemptions,
                "recomputed_tokens": stats.num_recomputed_tokens,
                "swap_out_blocks": stats.kv_swap_out_blocks,
                "swap_in_blocks": stats.kv_swap_in_blocks,
            }
    out["same_tokens"] = tokens["recompute"] == tokens["swap"]
    out["forward_tokens_ratio"] = round(
        out["recompute"]["forward_tokens"] / out["swap"]["forward_tokens"], 3
    )
    out["e2e_speedup"] = round(out["recompute"]["e2e_s"] / out["swap"]["e2e_s"], 3)
    out["cpu_speedup"] = round(out["recompute"]["cpu_s"] / out["swap"]["cpu_s"], 3)
    return out


def chat(args, model: str) -> dict:
    from tokenbudget.core import Request, SamplingParams

    turns, user_len, reply_len = args.turns, args.user_len, args.reply_len
    final_len = turns * (user_len + reply_len)
    working_set = args.conversations * -(-final_len // args.block_size)
    device_blocks = working_set // 4 + 1
    params = SamplingParams(max_tokens=reply_len, temperature=0.0, ignore_eos=True)
    out = {
        "workload": "chat",
        "conversations": args.conversations,
        "turns": turns,
        "user_len": user_len,
        "reply_len": reply_len,
        "working_set_blocks": working_set,
        "device_blocks": device_blocks - 1,
    }
    replies = {}
    for name, host in (("device_only", 0), ("host_tier", 2 * working_set)):
        llm = make_llm(args, model, device_blocks, host, final_len)
        engine = llm.engine
        histories = [[] for _ in range(args.conversations)]
        user_rng = np.random.default_rng(2)
        ttfts, all_replies, n = [], [], 0
        for _ in range(turns):
            for c in range(args.conversations):
                histories[c] += user_rng.integers(16, 1000, size=user_len).tolist()
                req = Request(
                    f"c{c}-{n}",
                    list(histories[c]),
                    params,
                    eos_token_id=None,
                    arrival_time=time.monotonic(),
                )
                n += 1
                t0 = time.perf_counter()
                engine.add_request(req)
                first, reply = None, []
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        if o.new_token_ids and first is None:
                            first = time.perf_counter() - t0
                        reply += o.new_token_ids
                ttfts.append(first)
                histories[c] += reply
                all_replies.append(reply)
        stats = engine.stats()
        replies[name] = all_replies
        t = np.array(ttfts) * 1000
        out[name] = {
            "prefix_hit_rate": round(stats.prefix_cache_hit_rate, 4),
            "ttft_ms_mean": round(float(t.mean()), 2),
            "ttft_ms_p50": round(float(np.percentile(t, 50)), 2),
            "ttft_ms_p90": round(float(np.percentile(t, 90)), 2),
            "swap_in_blocks": stats.kv_swap_in_blocks,
            "swap_out_blocks": stats.kv_swap_out_blocks,
        }
        llm.shutdown()
    out["same_tokens"] = replies["device_only"] == replies["host_tier"]
    out["ttft_mean_speedup"] = round(
        out["device_only"]["ttft_ms_mean"] / out["host_tier"]["ttft_ms_mean"], 3
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint (default: a random Qwen3 built locally from --hidden-size/--layers)",
    )
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="pressure: runs per configuration, alternating; the best time counts",
    )
    p.add_argument("--workload", choices=["pressure", "chat", "all"], default="all")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=192)
    p.add_argument("--reply-len", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    if args.workload in ("pressure", "all"):
        print(json.dumps(pressure(args, model)), flush=True)
    if args.workload in ("chat", "all"):
        print(json.dumps(chat(args, model)), flush=True)


if __name__ == "__main__":
    main()
