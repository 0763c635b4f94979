"""Multi-LoRA decode cost: step time of a 64-request decode batch whose
requests use 0, 1, 4 or 8 distinct adapters (ranks 8, 16, 64), against the
base model served without LoRA.

    python benchmarks/lora.py                     # the tiny model, built locally, CPU
    python benchmarks/lora.py --model Qwen/Qwen3-0.6B --device cuda --dtype bfloat16

Prints one JSON line per case: median decode step (ms), output tokens/s, the
forward's share, and the ratio to the base step; adapters are random PEFT
folders written here (A and B non-zero, every projection targeted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def write_adapter(model, folder: str, rank: int, seed: int) -> str:
    """A random PEFT LoRA folder for ``model`` (all seven projections)."""
    from safetensors.torch import save_file

    from tokenbudget.core.lora import TARGET_MODULES

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(m.out_features, rank, generator=gen) * 0.05
            )
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    config["target_modules"] = list(TARGET_MODULES)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def lora_rank(lora) -> int:
    with open(os.path.join(lora.lora_path, "adapter_config.json")) as f:
        return json.load(f)["r"]


def decode_steps(args, loras: list, enable_lora: bool) -> dict:
    """Median step time of ``args.steps`` all-decode steps of 64 requests,
    request i under ``loras[i % len(loras)]`` (no adapters: base requests)."""
    from tokenbudget.core import Request, SamplingParams
    from tokenbudget.server import LLM

    # As a user would set them: slots for the adapters, the rank they need.
    rank = max((lora_rank(lora) for lora in loras), default=8)
    extra = {"enable_lora": True, "max_loras": max(len(loras), 1), "max_lora_rank": rank}
    extra = extra if enable_lora else {}
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        async_scheduling=False,
        num_gpu_blocks=args.batch * 8 + 16,
        max_num_seqs=args.batch,
        **extra,
    )
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i in range(args.batch):
        prompt = [(97 * i + 13 * j) % 2000 + 50 for j in range(args.prompt_len)]
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(Request(f"b{i}", prompt, params, lora_request=lora))
    for _ in range(3):  # the prefill step, then warm decodes
        engine.step()
    runner = engine.executor.worker.model_runner
    runner.timings.clear()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    forward = runner.timings["forward"] / args.steps
    llm.shutdown()
    step = statistics.median(times)
    return {"step_ms": step * 1e3, "forward_ms": forward * 1e3, "tokens_per_s": args.batch / step}


def best_of(args, loras: list, enable_lora: bool) -> dict:
    """The fastest of ``args.repeats`` runs (the machine may be shared)."""
    runs = [decode_steps(args, loras, enable_lora) for _ in range(args.repeats)]
    return min(runs, key=lambda r: r["step_ms"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny Qwen3, built)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument(
        "--grouped", action="store_true", help="always the grouped form (worker/lora_layers.py)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest is kept")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.grouped:
        from tokenbudget.worker import lora_layers

        lora_layers.DENSE_MAX_ELEMENTS = 0
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    if args.model is None:
        from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

        args.model = build_tiny_qwen3(os.path.join(tmp, "model"), seed=0)
    from transformers import AutoModelForCausalLM

    from tokenbudget.core import LoRARequest

    hf = AutoModelForCausalLM.from_pretrained(args.model)
    base = best_of(args, [], enable_lora=False)
    print(json.dumps({"case": "base", "adapters": 0, **base}), flush=True)
    off = best_of(args, [], enable_lora=True)
    print(
        json.dumps(
            {"case": "lora-on", "adapters": 0, **off, "vs_base": off["step_ms"] / base["step_ms"]}
        ),
        flush=True,
    )
    for rank in args.ranks:
        loras = [
            LoRARequest(f"r{rank}-{k}", k + 1, write_adapter(hf, f"{tmp}/r{rank}-{k}", rank, k))
            for k in range(8)
        ]
        for n in (1, 4, 8):
            r = best_of(args, loras[:n], enable_lora=True)
            ratio = r["step_ms"] / base["step_ms"]
            print(
                json.dumps({"case": "lora", "rank": rank, "adapters": n, **r, "vs_base": ratio}),
                flush=True,
            )


if __name__ == "__main__":
    main()
