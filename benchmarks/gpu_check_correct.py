"""gpu_check.py's correctness helpers: random paged batches for the backend
comparison, the transformers and LLM greedy runs, pytest's summary line."""

from __future__ import annotations

import re

import numpy as np
import torch

BLOCK_SIZE = 16


def backend_problem(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run on ``device`` here, or None."""
    from tokenbudget.worker import attention_select as sel

    if backend == "triton":
        return sel.triton_problem(device)
    if backend == "cpu":
        if device.type != "cpu":
            return "the cpu backend runs on CPU"
        from tokenbudget.worker.attention_cpu import cpu_kernel_problem

        return cpu_kernel_problem()
    if backend == "flash_attn":
        if device.type != "cuda":
            return "flash-attn runs on CUDA"
        return sel.flash_attn_problem(device, torch.bfloat16)
    return f"unknown backend {backend}"


def random_paged_batch(rng: np.random.Generator, num_blocks: int, max_len: int):
    """(query_lens, seq_lens, block_tables): decodes and prompt chunks over
    cached contexts, in blocks drawn without replacement from 1.., where the
    first two requests share their first block (a prefix-cache hit)."""
    n = int(rng.integers(1, 7))
    seq_lens = rng.integers(1, max_len, size=n)
    decode = rng.random(n) < 0.5
    query_lens = np.where(decode, 1, [int(rng.integers(1, s + 1)) for s in seq_lens])
    width = -(-int(seq_lens.max()) // BLOCK_SIZE)
    ids = rng.permutation(np.arange(1, num_blocks))[: n * width].reshape(n, width)
    if n > 1 and seq_lens[0] > BLOCK_SIZE and seq_lens[1] > BLOCK_SIZE:
        ids[1, 0] = ids[0, 0]
    return query_lens, seq_lens, ids.astype(np.int32)


def compare_backend(backend, kernel, device, dtype, num_batches: int) -> tuple[float, float]:
    """The largest |backend - SDPA| over seeded random batches (the reference
    in float32 over the same cache), and the tolerance for ``dtype``."""
    from tokenbudget.worker import attention

    gen = torch.Generator(device="cpu").manual_seed(0)
    rng = np.random.default_rng(0)
    head_dim, num_blocks, worst = 128, 160, 0.0
    for i in range(num_batches):
        kv_heads, group = (1, 2, 8)[i % 3], (1, 4, 8)[i % 3]
        query_lens, seq_lens, tables = random_paged_batch(rng, num_blocks, 300)
        shape = (2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        cache = torch.randn(shape, generator=gen).to(device, dtype)
        q = torch.randn(int(query_lens.sum()), kv_heads * group, head_dim, generator=gen)
        q = q.to(device, dtype)
        slots = np.zeros(len(q), np.int64)  # the cache already holds every key

        def meta(name, c):
            return attention.build_metadata(
                name, [c], BLOCK_SIZE, query_lens, seq_lens, tables, slots, device
            )

        scale = head_dim**-0.5
        ref_cache = cache.float()
        want = attention._sdpa_attention(q.float(), ref_cache, meta("sdpa", ref_cache), scale)
        if kernel is None:  # flash_attn
            flat = cache.view(2, -1, kv_heads, head_dim)
            got = attention._flash_attention(q, cache, flat, meta(backend, cache), scale)
        else:
            got = kernel(q, cache[0], cache[1], meta(backend, cache), scale)
        worst = max(worst, float((got.float() - want).abs().max()))
    return round(worst, 6), (2e-4 if dtype == torch.float32 else 3e-2)


def hf_greedy(path: str, device: str, num_prompts: int, new_tokens: int):
    """Seeded prompts and transformers' greedy continuations (fp32, SDPA)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    rng = np.random.default_rng(1)
    lens = rng.integers(3, 120, size=num_prompts)
    prompts = [rng.integers(16, model.config.vocab_size - 64, size=n).tolist() for n in lens]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p], device=device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
            want.append(out[0, len(p) :].tolist())
    del model
    return prompts, want


def ensure_graphs(llm, on: bool) -> dict:
    """Graphs on or off in ``llm``'s in-process runner whatever the engine
    passed down. On CPU "on" replays through a capture stub (the forward run
    on the static buffers), which needs an in-place backend."""
    from tokenbudget.worker.attention import _PAGED_KERNEL_MODULES
    from tokenbudget.worker.cuda_graphs import capture_decode_graphs

    runner = llm.executor.worker.model_runner
    if not on:
        runner.cuda_graphs = None
        return {"graphs": "off"}
    if runner.cuda_graphs is None:
        runner.enforce_eager = False
        max_seqs = llm.scheduler_config.max_num_seqs
        if runner.device.type == "cuda":
            runner.cuda_graphs = capture_decode_graphs(runner, max_seqs)
        elif runner.attention_backend in _PAGED_KERNEL_MODULES:
            runner.cuda_graphs = capture_decode_graphs(runner, max_seqs, capture=lambda fn: fn)
    if runner.cuda_graphs is None:
        return {"graphs": f"not captured (backend {runner.attention_backend})"}
    kind = "cuda" if runner.device.type == "cuda" else "stubbed capture (cpu)"
    return {"graphs": kind, "graph_sizes": list(runner.cuda_graphs.sizes)}


def llm_greedy(path: str, device: str, prompts, new_tokens: int, graphs: bool):
    """Greedy tokens through LLM (fp32) with graphs on or off."""
    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    llm = LLM(
        path,
        dtype="float32",
        device=device,
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks=256,
        enforce_eager=True,  # no torch.compile; ensure_graphs adds the graphs
    )
    try:
        info = ensure_graphs(llm, graphs)
        runner = llm.executor.worker.model_runner
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        info["backend"] = runner.attention_backend
        info["graph_replays"] = runner.cuda_graphs.num_replays if runner.cuda_graphs else 0
        return [o.token_ids for o in outs], info
    finally:
        llm.shutdown()


def pytest_counts(line: str) -> dict[str, int]:
    """'3 passed, 1 skipped, 2 deselected in 4.1s' -> {'passed': 3, ...}."""
    return {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", line)}
