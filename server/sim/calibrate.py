"""Calibration: measure real worker steps across batch shapes, fit the cost
model's constants, report the fit error.

``measure`` drives a real ``Worker`` (its ``ModelRunner.execute_model``)
with the real Scheduler and times every step, recording the step's shape
(new tokens and context per request). It needs torch and imports it here
only. ``fit_recorded`` fits a recording (the JSON ``measure`` writes); the
tests fit a committed recording, so the fit is checked without measuring.

On CPU the model is a small random-weight Qwen3 built locally; the CPU's
"hardware profile" holds nominal figures only, so its fitted efficiencies
are relative to them. The constants transfer to a GPU profile only as far as
the host overheads do: GPU predictions stay roofline extrapolations until a
recording made on that GPU is fitted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tokenbudget.server.sim.cost_model import FitReport, fit
from tokenbudget.server.sim.profiles import HardwareProfile, ModelProfile

# Nominal figures for a CPU core: a placeholder the fitted efficiencies scale.
CPU_NOMINAL = HardwareProfile(
    "cpu-nominal", peak_flops=1e11, memory_bandwidth=1e10, memory_bytes=8e9
)
# The measured model: small enough for a CPU, big enough that FLOPs and
# bytes, not only Python, show in the step time.
CALIBRATION_MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
)
# (requests, prompt tokens, output tokens, max_num_batched_tokens)
SCENARIOS = [
    (1, 32, 16, 2048),
    (1, 512, 8, 2048),
    (4, 128, 16, 2048),
    (8, 256, 12, 2048),
    (16, 64, 16, 2048),
    (32, 32, 12, 2048),
    (2, 1024, 4, 256),
    (12, 192, 8, 512),
]


def _kind(shape: list[tuple[int, int]]) -> str:
    if all(n == 1 for n, _ in shape):
        return "decode"
    if all(n > 1 for n, _ in shape):
        return "prefill"
    return "mixed"


def measure(
    model_path: str | None = None,
    scenarios=SCENARIOS,
    repeats: int = 2,
    threads: int = 1,
    device: str = "cpu",
) -> dict[str, Any]:
    """Time every step of each scenario (``repeats`` runs, the first a warm-up
    that is not kept). Returns a JSON-able recording."""
    import tempfile

    import torch

    from tokenbudget.core import CacheConfig, Scheduler, SchedulerConfig
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3
    from tokenbudget.worker.worker import Worker

    torch.set_num_threads(threads)
    tmp = None
    if model_path is None:
        tmp = tempfile.TemporaryDirectory()
        model_path = build_tiny_qwen3(Path(tmp.name) / "model", **CALIBRATION_MODEL)
    config = json.loads((Path(model_path) / "config.json").read_text())
    profile = ModelProfile.from_hf_config(
        config, name="calibration-qwen3", dtype_bytes=4 if device == "cpu" else 2
    )
    worker = Worker(model_path, device=device, dtype="float32" if device == "cpu" else "auto")
    steps: list[dict[str, Any]] = []
    for b, p, d, budget in scenarios:
        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=256, max_model_len=4096
        )
        cache_cfg = CacheConfig(
            block_size=16, num_blocks=b * (p + d) // 16 + 2 * b + 4, enable_prefix_caching=False
        )
        worker.initialize(cache_cfg, sched_cfg)
        sched = Scheduler(sched_cfg, cache_cfg)
        # The first run warms the fresh KV cache up (first touches cost more).
        for run in range(repeats):
            _add_requests(sched, run, b, p, d)
            if run > 0 or repeats == 1:
                steps += _timed_steps(sched, worker, device, f"b{b}-p{p}-t{budget}")
            else:
                _timed_steps(sched, worker, device, "")
    worker.shutdown()
    if tmp is not None:
        tmp.cleanup()
    return {
        "model": profile.to_dict(),
        "device": device,
        "threads": threads,
        "torch": torch.__version__,
        "steps": steps,
    }


def _add_requests(sched, run: int, b: int, p: int, d: int) -> None:
    """Queue run ``run``'s ``b`` requests of ``p`` prompt and ``d`` output tokens."""
    from tokenbudget.core import Request, SamplingParams

    for k in range(b):
        prompt = [(k * 131 + 7 * j) % 1000 + 1 for j in range(p)]
        sched.add_request(
            Request(
                f"c{run}-{b}-{p}-{k}",
                prompt,
                SamplingParams(max_tokens=d, ignore_eos=True, temperature=0.0),
            )
        )


def _timed_steps(sched, worker, device: str, label: str) -> list[dict[str, Any]]:
    """Run ``sched``'s requests to the end on ``worker``, timing each step."""
    import torch

    steps: list[dict[str, Any]] = []
    while True:
        so = sched.schedule()
        if so.is_empty:
            worker.execute_model(so)  # tells the worker what finished
            return steps
        start = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        start.update(zip(c.req_ids, c.num_computed_tokens))
        shape = [(n, start[rid]) for rid, n in so.num_scheduled_tokens.items()]
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = worker.execute_model(so)
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        sched.update_from_output(so, out)
        steps.append({"shape": shape, "seconds": dt, "group": f"{label}:{_kind(shape)}"})


def fit_recorded(recording: dict[str, Any], hardware: HardwareProfile = CPU_NOMINAL) -> FitReport:
    model = ModelProfile(**recording["model"])
    steps = [([tuple(x) for x in s["shape"]], s["seconds"]) for s in recording["steps"]]
    return fit(model, hardware, steps, [s["group"] for s in recording["steps"]])
