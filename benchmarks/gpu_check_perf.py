"""gpu_check.py's sections 3-5: KV sizing, throughput against the measured
HBM roofline, serving and structured output; and the PNG."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu_check_correct import backend_problem, ensure_graphs

# Qwen3-0.6B's shape (random weights; tied embeddings as in the checkpoint).
QWEN3_06B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    context: int
    # Output tokens per request; only steps where the whole batch decodes are
    # timed (early ones overlap other requests' prompt chunks).
    decode_steps: int
    prefill: tuple[int, int]  # requests x tokens
    max_model_len: int
    max_num_batched_tokens: int
    serve: tuple[int, int, int, int]  # concurrency, requests, prompt, output tokens


FULL = Sizes((1, 64, 256), 1024, 48, (8, 2048), 2304, 16384, (64, 192, 256, 64))
QUICK = Sizes((1, 4), 32, 4, (2, 64), 128, 512, (4, 8, 16, 8))


def engine_kwargs(device: str, quick: bool, sizes: Sizes) -> dict:
    """LLM keywords shared by the sections: eager at construction (no
    torch.compile: its cold compile would eat the budget), graphs added by
    ensure_graphs; on CPU a fixed KV size (no memory profile there)."""
    kv = {"kv_cache_memory": "64MiB"} if device == "cpu" else {"gpu_memory_utilization": 0.9}
    return dict(
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        max_num_seqs=max(max(sizes.batches), sizes.serve[0]),
        max_model_len=sizes.max_model_len,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        enable_prefix_caching=False,
        # Steps one at a time: the probe pairs each engine step with its forward.
        async_scheduling=False,
        enforce_eager=True,
        **kv,
    )


def make_model(work: Path, device: str, quick: bool) -> dict:
    """A random-weight Qwen3 of the measured shape (bf16), saved as a checkpoint
    with the tiny test tokenizer (prompts are token ids; the ids it lacks
    decode to nothing)."""
    import transformers

    from tokenbudget.server.testing.tiny_models import build_tokenizer, padded_vocab_size

    path = work / ("qwen3_tiny" if quick else "qwen3_0.6b_shape")
    tokenizer = build_tokenizer(path)
    shape = dict(TINY, vocab_size=padded_vocab_size(len(tokenizer))) if quick else QWEN3_06B
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.Qwen3Config(**shape, eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(str(path))
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"path": str(path), "parameters": params, "shape": shape}


def kv_sizing(path: str, device: str, quick: bool) -> dict:
    """Blocks the KV sizing gave vs the arithmetic: (total x 0.9 - weights) /
    bytes per block on a GPU (the profile's activations take the rest), the
    configured bytes / bytes per block on CPU."""
    from tokenbudget.server import LLM

    sizes = QUICK if quick else FULL
    llm = LLM(path, **engine_kwargs(device, quick, sizes))
    try:
        runner = llm.executor.worker.model_runner
        cache = runner.kv_caches[0]
        blocks = cache.shape[1]
        per_block = cache.numel() // blocks * cache.element_size() * len(runner.kv_caches)
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        if device == "cuda":
            total = torch.cuda.mem_get_info()[1]
            budget = int(total * 0.9) - weights
        else:
            total, budget = None, 64 << 20
        arithmetic = budget // per_block
        ratio = blocks / arithmetic
        return {
            "blocks": int(blocks),
            "bytes_per_block": int(per_block),
            "kv_bytes": int(blocks * per_block),
            "weights_bytes": int(weights),
            "device_total_bytes": total,
            "arithmetic_blocks": int(arithmetic),
            "blocks_over_arithmetic": round(ratio, 4),
            # The profile's activation peak is the only gap allowed (a few %).
            "pass": 0.9 <= ratio <= 1.0,
        }
    finally:
        llm.shutdown()


def bandwidth(device: str, quick: bool) -> dict:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    n = (64 << 20) if quick or device != "cuda" else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 5 if quick else 20
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    seconds = time.perf_counter() - t0
    return {"bytes_copied": n, "repeats": reps, "gb_per_s": round(2 * n * reps / seconds / 1e9, 1)}


class StepProbe:
    """Per engine step: wall seconds, forward seconds (CUDA events around the
    runner's forward, so device time; wall time on CPU), whether the step was
    decode-only and how many requests it held."""

    def __init__(self, llm) -> None:
        self.runner = runner = llm.executor.worker.model_runner
        self.cuda = runner.device.type == "cuda"
        self.steps: list[tuple[float, float, bool, int]] = []
        self._current: list = []
        step, execute, forward = llm.engine.step, runner.execute_model, runner._forward

        def timed_step():
            self._current = []
            t0 = time.perf_counter()
            out = step()
            wall = time.perf_counter() - t0
            if len(self._current) == 3:
                decode_only, n, fwd = self._current
                self.steps.append((wall, fwd(), decode_only, n))
            return out

        def timed_execute(so):
            n = len(so.num_scheduled_tokens)
            self._current = [so.total_num_scheduled_tokens == n, n]
            return execute(so)

        def timed_forward(*args):
            if not self.cuda:
                t0 = time.perf_counter()
                out = forward(*args)
                seconds = time.perf_counter() - t0
                self._current.append(lambda: seconds)
                return out
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = forward(*args)
            end.record()
            self._current.append(lambda: (end.synchronize(), start.elapsed_time(end) / 1e3)[1])
            return out

        llm.engine.step, runner.execute_model, runner._forward = (
            timed_step,
            timed_execute,
            timed_forward,
        )


def _prompts(rng: np.random.Generator, n: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": rng.integers(16, 1000, size=length).tolist()} for _ in range(n)]


def weights_read_per_step(model: torch.nn.Module) -> int:
    """Weight bytes a decode step reads: every matrix once; an untied input
    embedding only at the batch's rows (left out)."""
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight.data_ptr() != embed.data_ptr():
        unique.pop(embed.data_ptr(), None)
    return sum(unique.values())


def decode_run(llm, probe: StepProbe, batch: int, sizes: Sizes, bw: float | None) -> dict:
    """Decode at ``batch`` with ``sizes.context`` tokens of context."""
    from tokenbudget.core import SamplingParams

    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=sizes.decode_steps + 1, temperature=0.0, ignore_eos=True)
    graphs = probe.runner.cuda_graphs
    replays = graphs.num_replays if graphs else 0
    probe.steps.clear()
    llm.generate(_prompts(rng, batch, sizes.context), params)
    steps = [s for s in probe.steps if s[2] and s[3] == batch][1:]  # the first: warm-up
    if not steps:
        raise RuntimeError(
            f"no decode step of {batch} requests was seen ({len(probe.steps)} steps)"
        )
    wall, fwd = sum(s[0] for s in steps), sum(s[1] for s in steps)
    cfg = probe.runner.model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    kv_per_token *= probe.runner.kv_caches[0].element_size()
    read = weights_read_per_step(probe.runner.model)
    read += batch * (sizes.context + sizes.decode_steps // 2) * kv_per_token
    step_s = wall / len(steps)
    return {
        "decode_steps_timed": len(steps),
        "tokens_per_s": round(batch / step_s, 1),
        "ms_per_step": round(step_s * 1e3, 3),
        "forward_ms_per_step": round(fwd / len(steps) * 1e3, 3),
        "outside_forward_share": round(max(0.0, 1 - fwd / wall), 3),
        "bytes_read_per_step": int(read),
        "hbm_roofline_fraction": float(f"{read / step_s / (bw * 1e9):.3g}") if bw else None,
        "graph_replays": (graphs.num_replays - replays) if graphs else 0,
    }


def prefill_run(llm, probe: StepProbe, sizes: Sizes) -> dict:
    from tokenbudget.core import SamplingParams

    n, length = sizes.prefill
    probe.steps.clear()
    t0 = time.perf_counter()
    llm.generate(_prompts(np.random.default_rng(7), n, length), SamplingParams(max_tokens=1))
    seconds = time.perf_counter() - t0
    return {
        "requests": n,
        "prompt_tokens": length,
        "steps": len(probe.steps),
        "tokens_per_s": round(n * length / seconds, 1),
    }


def throughput(
    path: str, device: str, quick: bool, backend: str, bw: float | None, graphs: bool = True
) -> dict:
    """One backend: decode at each batch size, then prefill, through LLM. With
    ``graphs`` off (the eager comparison): the two smaller batches, no prefill."""
    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    sizes = QUICK if quick else FULL
    llm = LLM(path, attention_backend=backend, **engine_kwargs(device, quick, sizes))
    try:
        info = ensure_graphs(llm, graphs)
        probe = StepProbe(llm)
        warm = SamplingParams(max_tokens=3, ignore_eos=True)  # kernels built, not timed
        llm.generate(_prompts(np.random.default_rng(0), 2, sizes.context), warm)
        for b in sizes.batches if graphs else sizes.batches[:2]:
            info[f"decode_b{b}"] = decode_run(llm, probe, b, sizes, bw)
        if graphs:
            info["prefill"] = prefill_run(llm, probe, sizes)
        # Host seconds per runner phase over the item (launches, not device time).
        info["runner_host_seconds"] = {k: round(v, 3) for k, v in probe.runner.timings.items()}
        return info
    finally:
        llm.shutdown()


def timed_backends(device: str, names: str | None) -> list[str]:
    wanted = names.split(",") if names else ["triton", "flash_attn", "cpu", "sdpa"]
    dev = torch.device(device)
    return [b for b in wanted if b == "sdpa" or backend_problem(b, dev) is None]


def attention_decode(device: str, quick: bool) -> dict:
    """One layer's decode attention, triton in place vs SDPA with a gather
    (worker/attention_bench.py), at 4k context; on CPU tiny shapes in
    triton's interpreter (a code-path check, not a timing)."""
    if importlib.util.find_spec("tokenbudget.worker.attention_bench") is None:
        return {"skipped": "missing", "missing": "worker/attention_bench.py:benchmark_decode"}
    if device != "cuda":
        code = (
            "import json, torch; from tokenbudget.worker.attention_bench import benchmark_decode"
            " as b; print(json.dumps(b(batch_size=2, context_len=40, num_heads=8, num_kv_heads=2,"
            " head_dim=16, dtype=torch.float32, device='cpu', iters=1, warmup=0)))"
        )
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=50
        )
        if proc.returncode:
            raise RuntimeError(proc.stderr[-1500:])
        runs = {"interpreted_b2_ctx40": json.loads(proc.stdout.strip().splitlines()[-1])}
        tol = 1e-4
    else:
        from tokenbudget.worker.attention_bench import benchmark_decode

        runs = {
            f"b{b}_ctx{c}": benchmark_decode(batch_size=b, context_len=c)
            for b, c in ((64, 4096), (256, 1024))
        }
        tol = 3e-2
    return {**runs, "pass": all(r["max_abs_diff"] <= tol for r in runs.values())}
