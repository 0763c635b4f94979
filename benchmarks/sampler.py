"""Sampler step time with logits processors ON vs OFF; prints one JSON line per case.

A step is what ModelRunner._sample pays after the forward: the rows' token history from the
persistent batch, SamplingMetadata.from_params (which builds the penalty inputs) and the
Sampler forward. Every row has a ~256-token prompt and ~64 output tokens in a real InputBatch.
ON adds repetition, frequency and presence penalties and a 4-token logit_bias to every row;
OFF is the same sampling without them. Steps alternate ON/OFF so load on a shared box hits both
alike; medians are reported with their ratio (and the median of neighbouring pairs' ratios).

    python benchmarks/sampler.py [--rows 64,256 --vocab 1216,152000 --device cpu]
    python benchmarks/sampler.py --end-to-end   # whole generations through LLM, tiny model

``--end-to-end`` times what a user pays: LLM.generate of N prompts (256 tokens, 64 outputs,
temperature 1) on the tiny random-weight Qwen3, with the same processors ON vs OFF, alternating,
median of ``--e2e-repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.input_batch import InputBatch, RequestState
from tokenbudget.worker.sampler import Sampler, SamplingMetadata

PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}


def make_batch(
    rows: int, vocab: int, prompt_len: int, output_len: int, rng: np.random.Generator
) -> tuple[InputBatch, list[int]]:
    """A batch whose rows hold prompt + output tokens, lengths jittered by up to 1/8."""
    batch = InputBatch(rows, prompt_len * 2 + output_len * 2, max_blocks_per_req=1)
    num_prompt = []
    for _ in range(rows):
        n_prompt = int(rng.integers(prompt_len * 7 // 8, prompt_len * 9 // 8 + 1))
        n_out = int(rng.integers(output_len * 7 // 8, output_len * 9 // 8 + 1))
        row = batch.add(rng.integers(0, vocab, n_prompt).tolist(), [])
        batch.append_tokens(row, rng.integers(0, vocab, n_out).tolist())
        num_prompt.append(n_prompt)
    return batch, num_prompt


def step(
    batch: InputBatch,
    states: list[RequestState],
    rows: np.ndarray,
    sampler: Sampler,
    logits: torch.Tensor,
    device: str,
) -> None:
    # As ModelRunner._sample and _token_history do it (no drafts here).
    num_prompt = np.fromiter((s.num_prompt_tokens for s in states), np.int64, len(states))
    history = batch.history(rows, num_prompt, np.zeros(len(rows), np.int64))
    metadata = SamplingMetadata.from_params(
        [s.sampling_params for s in states], [s.generator for s in states], device, history
    )
    sampler(logits, metadata).sampled_token_ids.tolist()


def run_case(rows: int, vocab: int, temperature: float, args, rng: np.random.Generator) -> dict:
    batch, num_prompt = make_batch(rows, vocab, args.prompt_len, args.output_len, rng)
    batch_rows = np.arange(rows, dtype=np.int64)
    logits = torch.randn(rows, vocab, device=args.device) * 3

    def states(extra: dict) -> list[RequestState]:
        out = []
        for i, n in enumerate(num_prompt):
            bias = {int(t): 2.0 for t in rng.integers(0, vocab, 4)} if extra else None
            params = SamplingParams(temperature=temperature, logit_bias=bias, **extra)
            out.append(RequestState(f"r{i}", n, params, row=i))
        return out

    configs = {"off": states({}), "on": states(PENALTIES)}
    sampler = Sampler()
    repeat = args.repeat if vocab <= 16_384 else args.repeat_large
    times: dict[str, list[float]] = {name: [] for name in configs}
    for i in range(repeat + 2):
        for name, st in configs.items():
            if args.device != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            step(batch, st, batch_rows, sampler, logits, args.device)
            if i >= 2:  # the first two rounds warm up
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    pairs = [on / off for on, off in zip(times["on"], times["off"])]
    return {
        "rows": rows,
        "vocab": vocab,
        "sampling": "greedy" if temperature == 0 else "random",
        "device": args.device,
        "threads": torch.get_num_threads(),
        "repeats": repeat,
        "off_us": round(med["off"] * 1e6, 1),
        "on_us": round(med["on"] * 1e6, 1),
        "on_over_off": round(med["on"] / med["off"], 3),
        "on_over_off_paired_median": round(statistics.median(pairs), 3),
    }


def end_to_end(rows: int, args) -> dict:
    import tempfile

    from tokenbudget.server import LLM
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(build_tiny_qwen3(tmp), num_gpu_blocks=rows * 24 + 64, max_num_seqs=rows)
    prompts = [
        {"prompt_token_ids": rng.integers(10, 1100, args.prompt_len).tolist()} for _ in range(rows)
    ]
    extra = {"off": {}, "on": dict(PENALTIES, logit_bias={5: 2.0, 6: -2.0, 7: 2.0, 8: 0.5})}
    times: dict[str, list[float]] = {name: [] for name in extra}
    # The worker's own phase timings: per-step cost of a whole step vs of sampling.
    runner = llm.executor.worker.model_runner
    phases: dict[str, list[dict]] = {name: [] for name in extra}
    for _ in range(args.e2e_repeat):
        for name, kw in extra.items():
            llm.engine.reset_prefix_cache()
            params = SamplingParams(
                max_tokens=args.output_len, temperature=1.0, seed=1, ignore_eos=True, **kw
            )
            runner.timings.clear()
            t = time.perf_counter()
            llm.generate(prompts, params)
            times[name].append(time.perf_counter() - t)
            phases[name].append(dict(runner.timings))
    llm.shutdown()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    step = {name: statistics.median(sum(p.values()) for p in ps) for name, ps in phases.items()}
    sample = {name: statistics.median(p["sample"] for p in ps) for name, ps in phases.items()}
    return {
        "mode": "end_to_end",
        "rows": rows,
        "off_s": round(med["off"], 3),
        "on_s": round(med["on"], 3),
        "on_over_off": round(med["on"] / med["off"], 3),
        "worker_s": {k: round(v, 3) for k, v in step.items()},
        "worker_on_over_off": round(step["on"] / step["off"], 3),
        "sample_s": {k: round(v, 3) for k, v in sample.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="64,256")
    p.add_argument("--vocab", default="1216,152000")
    p.add_argument("--sampling", default="random,greedy")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=201, help="steps per config, small vocab")
    p.add_argument("--repeat-large", type=int, default=9, help="steps per config, large vocab")
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument(
        "--end-to-end",
        action="store_true",
        help="time whole LLM.generate runs instead of the sampler alone",
    )
    p.add_argument("--e2e-repeat", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.end_to_end:
        for rows in map(int, args.rows.split(",")):
            print(json.dumps(end_to_end(rows, args)), flush=True)
        return
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    temperatures = {"random": 1.0, "greedy": 0.0}
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            for sampling in args.sampling.split(","):
                print(
                    json.dumps(run_case(rows, vocab, temperatures[sampling], args, rng)), flush=True
                )


if __name__ == "__main__":
    main()
