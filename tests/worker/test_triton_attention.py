"""The triton paged-attention backend on a CPU-only machine: the kernel itself
runs in triton's interpreter, in a subprocess (triton_interpreter_cases.py
says why); here, which backend ``auto`` and ``triton`` resolve to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenbudget.worker import attention_select
from tokenbudget.worker.attention_select import resolve_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
CASES = Path(__file__).with_name("triton_interpreter_cases.py")


def test_triton_kernel_equals_the_oracle_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", CPU, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", CPU, torch.float32) == "triton"


def test_triton_is_refused_by_name_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(attention_select, "triton_problem", lambda device: "not installed")
    with pytest.raises(ValueError, match="attention_backend='triton': not installed"):
        resolve_backend("triton", CUDA, torch.bfloat16)


@pytest.mark.parametrize(
    "flash_works,block_size,picked",
    [
        (True, None, "flash_attn"),  # block size not known yet
        (True, 256, "flash_attn"),
        (True, 16, "triton"),  # flash-attn would gather each context per layer
        (False, 256, "triton"),
    ],
)
def test_auto_on_cuda_picks_triton_unless_flash_attn_reads_the_pages(
    monkeypatch, flash_works, block_size, picked
):
    monkeypatch.setattr(attention_select, "flash_attn_available", lambda: flash_works)
    monkeypatch.setattr(attention_select, "flash_attn_problem", lambda device, dtype: None)
    monkeypatch.setattr(attention_select, "triton_problem", lambda device: None)
    assert resolve_backend("auto", CUDA, torch.bfloat16, block_size=block_size) == picked
    assert resolve_backend("auto", CUDA, torch.float32, block_size=block_size) == "triton"


def test_auto_on_cuda_without_triton_keeps_to_flash_attn_or_sdpa(monkeypatch):
    monkeypatch.setattr(attention_select, "flash_attn_available", lambda: True)
    monkeypatch.setattr(attention_select, "flash_attn_problem", lambda device, dtype: None)
    monkeypatch.setattr(attention_select, "triton_problem", lambda device: "not installed")
    assert resolve_backend("auto", CUDA, torch.bfloat16, block_size=16) == "flash_attn"
    assert resolve_backend("auto", CUDA, torch.float32, block_size=16) == "sdpa"


def test_the_runner_resolves_auto_again_once_the_block_size_is_known(tiny_qwen3_path, monkeypatch):
    from tokenbudget.core import CacheConfig, SchedulerConfig
    from tokenbudget.worker import model_runner

    calls = []

    def resolve(name, device, dtype, *, block_size=None):
        calls.append((name, block_size))
        return "sdpa"

    monkeypatch.setattr(model_runner, "resolve_backend", resolve)
    runner = model_runner.ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu")
    runner.initialize_kv_cache(
        CacheConfig(block_size=32, num_blocks=4), SchedulerConfig(max_model_len=64)
    )
    assert calls == [("auto", None), ("auto", 32)]
