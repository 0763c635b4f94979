"""Embedding throughput: LLM.embed (pooling requests through the token-budget
scheduler) against transformers' base model run on padded static batches, on
the same seeded prompts, pooled the same way (last token, L2-normalised).

    python benchmarks/embed.py --num-prompts 256                 # tiny model built locally
    python benchmarks/embed.py --model Qwen/Qwen3-0.6B --device cuda --dtype bfloat16

Prints one JSON object: prompt tokens/s for both, their ratio, and the
largest difference between the two sets of vectors (a correctness check).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch


def make_prompts(num_prompts: int, vocab: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Skip the first ids: special tokens in the tiny tokenizer.
    return [
        rng.integers(16, vocab, size=n).tolist() for n in rng.integers(lo, hi + 1, size=num_prompts)
    ]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_ours(args, prompts) -> tuple[float, torch.Tensor]:
    from tokenbudget.core import PoolingParams
    from tokenbudget.server import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks=args.num_gpu_blocks,
        enable_prefix_caching=False,
    )
    params = PoolingParams("LAST", True)
    llm.embed([{"prompt_token_ids": p} for p in prompts[:4]], params)  # warm up
    sync(args.device)
    t = time.perf_counter()
    out = llm.embed([{"prompt_token_ids": p} for p in prompts], params)
    sync(args.device)
    seconds = time.perf_counter() - t
    llm.shutdown()
    return seconds, torch.tensor([o.embedding for o in out])


@torch.inference_mode()
def run_transformers(args, prompts) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel

    dtype = {
        "auto": None,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[args.dtype]
    model = AutoModel.from_pretrained(args.model, dtype=dtype or "auto").to(args.device).eval()

    def embed(batch: list[list[int]]) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # right padding: causal attention never sees it
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        hidden = model(
            input_ids=ids.to(args.device), attention_mask=mask.to(args.device)
        ).last_hidden_state
        last = torch.tensor([len(p) - 1 for p in batch], device=args.device)
        vec = hidden[torch.arange(len(batch), device=args.device), last].float()
        return torch.nn.functional.normalize(vec, dim=-1).cpu()

    embed(prompts[:4])  # warm up
    sync(args.device)
    t = time.perf_counter()
    vectors = [embed(prompts[i : i + args.hf_batch]) for i in range(0, len(prompts), args.hf_batch)]
    sync(args.device)
    return time.perf_counter() - t, torch.cat(vectors)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the tiny Qwen3 built locally")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--hf-batch", type=int, default=32, help="transformers' static batch size")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

        args.model = build_tiny_qwen3(tempfile.mkdtemp(prefix="tiny_qwen3_"), seed=0)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    prompts = make_prompts(args.num_prompts, vocab, args.seed, *args.input_len)
    num_tokens = sum(len(q) for q in prompts)
    ours_s, ours = run_ours(args, prompts)
    hf_s, theirs = run_transformers(args, prompts)
    print(
        json.dumps(
            {
                "model": args.model,
                "device": args.device,
                "dtype": args.dtype,
                "num_prompts": len(prompts),
                "prompt_tokens": num_tokens,
                "ours_tokens_per_s": round(num_tokens / ours_s, 1),
                "transformers_tokens_per_s": round(num_tokens / hf_s, 1),
                "ratio": round(hf_s / ours_s, 3),
                "max_abs_diff": float((ours - theirs).abs().max()),
            }
        )
    )


if __name__ == "__main__":
    main()
