"""Tensor parallelism on CPU: step time of TP=1 against TP=2, and what the
all-reduces cost, on a Qwen3-shaped model big enough for compute to matter
(random weights, built locally: hidden 1024, 8 layers, 16 heads / 8 KV heads,
intermediate 3072, vocabulary 8192 so that the replicated lm_head does not
dominate).

    python benchmarks/tensor_parallel.py                 # prints one JSON object

Part 1 ("steps") runs the real Worker step on each rank: every rank owns a
Scheduler fed the same requests (deterministic, so they schedule the same
steps in lockstep without any broadcast) and the rank's TensorParallelGroup
counts the seconds spent in the row-parallel all-reduces. Cases: TP=1 with 1
torch thread, TP=1 with 2 threads (the same cores TP=2 uses), TP=2 with 1
thread per rank. Reported: median prefill-step and decode-step milliseconds,
and all-reduce milliseconds per step.

Part 2 ("end_to_end") is LLM.generate with tensor_parallel_size 1 and 2 on the
same workload: what a user sees, including rank 0's gRPC stream and the
broadcast of each step to the other ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

MODEL = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=3072,
    vocab_size=8192,
    max_position_embeddings=4096,
)


def build_model(path: str) -> str:
    import transformers

    from tokenbudget.server.testing.tiny_models import build_tokenizer

    build_tokenizer(path)
    config = transformers.Qwen3Config(
        **MODEL, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(path)
    return path


def workload(args):
    from tokenbudget.core import SamplingParams
    from tokenbudget.core.request import Request

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(16, MODEL["vocab_size"], (args.prompt_len,), generator=g).tolist()
        for _ in range(args.batch)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    return prompts, params, lambda: [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]


def run_steps(
    rank: int, world_size: int, threads: int, path: str, args, port: int, results
) -> None:
    """One rank (or the single TP=1 process): the real step loop, timed."""
    from tokenbudget.core.config import CacheConfig, SchedulerConfig
    from tokenbudget.core.sched.scheduler import Scheduler
    from tokenbudget.worker.worker import Worker

    torch.set_num_threads(threads)
    group = None
    if world_size > 1:
        from tokenbudget.worker.parallel.group import TensorParallelGroup

        group = TensorParallelGroup(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s=600)
        group.use_device(torch.device("cpu"))
    worker = Worker(
        path, dtype="float32", device="cpu", attention_backend="sdpa", seed=0, parallel=group
    )
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.batch * args.prompt_len,
        max_num_seqs=args.batch,
        max_model_len=4096,
    )
    cache_cfg = CacheConfig(
        block_size=16, num_blocks=args.batch * 16 + 1, enable_prefix_caching=False
    )
    worker.initialize(cache_cfg, sched_cfg)
    _, _, make_requests = workload(args)
    prefill, decode, reduce_prefill, reduce_decode = [], [], [], []
    for repeat in range(args.repeats + 1):  # the first round warms up
        scheduler = Scheduler(sched_cfg, cache_cfg)
        for r in make_requests():
            r.request_id = f"{repeat}-{r.request_id}"
            scheduler.add_request(r)
        while scheduler.has_unfinished_requests():
            so = scheduler.schedule()
            reduce_before = group.reduce_seconds if group else 0.0
            t = time.perf_counter()
            out = worker.execute_model(so)
            dt = time.perf_counter() - t
            dr = (group.reduce_seconds if group else 0.0) - reduce_before
            scheduler.update_from_output(so, out)
            if repeat == 0 or so.total_num_scheduled_tokens == 0:
                continue
            is_decode = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)
            (decode if is_decode else prefill).append(dt)
            (reduce_decode if is_decode else reduce_prefill).append(dr)
    if rank == 0:

        def ms(xs):
            return round(1000 * statistics.median(xs), 2) if xs else None

        results.put(
            {
                "prefill_step_ms": ms(prefill),
                "decode_step_ms": ms(decode),
                "allreduce_ms_per_prefill_step": ms(reduce_prefill),
                "allreduce_ms_per_decode_step": ms(reduce_decode),
                "decode_steps_measured": len(decode),
            }
        )


def steps_case(world_size: int, threads: int, path: str, args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=run_steps, args=(r, world_size, threads, path, args, port, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out = results.get(timeout=1800)
    for p in procs:
        p.join(60)
    return {"tp": world_size, "threads_per_rank": threads, **out}


def end_to_end(tp: int, path: str, args) -> dict:
    from tokenbudget.server import LLM

    prompts, params, _ = workload(args)
    torch.set_num_threads(1)
    llm = LLM(
        path,
        tensor_parallel_size=tp,
        dtype="float32",
        device="cpu",
        num_gpu_blocks=args.batch * 16 + 1,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * args.prompt_len,
    )
    try:
        batch = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(batch, params)  # warm-up
        t = time.perf_counter()
        out = llm.generate(batch, params)
        wall = time.perf_counter() - t
    finally:
        llm.shutdown()
    tokens = sum(len(r.token_ids) for r in out)
    return {
        "tp": tp,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1),
        "token_ids": [r.token_ids for r in out],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-end-to-end", action="store_true")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(os.path.join(tmp, "model"))
        steps = [
            steps_case(1, 1, path, args),
            steps_case(1, 2, path, args),
            steps_case(2, 1, path, args),
        ]
        report = {
            "model": MODEL,
            "cpu_count": os.cpu_count(),
            # Other processes on the box skew every figure: read them with it.
            "load_average_1min_at_start": round(load_at_start, 2),
            "workload": {
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
            },
            "steps": steps,
        }
        base = steps[0]
        tp2 = steps[2]
        report["decode_speedup_tp2_vs_tp1_1thread"] = round(
            base["decode_step_ms"] / tp2["decode_step_ms"], 3
        )
        report["decode_speedup_tp2_vs_tp1_2threads"] = round(
            steps[1]["decode_step_ms"] / tp2["decode_step_ms"], 3
        )
        report["prefill_speedup_tp2_vs_tp1_1thread"] = round(
            base["prefill_step_ms"] / tp2["prefill_step_ms"], 3
        )
        report["allreduce_share_of_tp2_decode_step"] = round(
            tp2["allreduce_ms_per_decode_step"] / tp2["decode_step_ms"], 3
        )
        if not args.skip_end_to_end:
            e2e = [end_to_end(1, path, args), end_to_end(2, path, args)]
            report["end_to_end"] = e2e
            report["end_to_end_same_tokens"] = e2e[0].pop("token_ids") == e2e[1].pop("token_ids")
            report["end_to_end_speedup_tp2_vs_tp1"] = round(e2e[0]["wall_s"] / e2e[1]["wall_s"], 3)
        report["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
