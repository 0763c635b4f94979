"""Which attention backend ``auto`` picks: flash-attn only when it imports
and passes a tiny self-check on the device, else SDPA with a warning. Fake
flash_attn modules stand in for broken installs (no GPU needed)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from tokenbudget.worker import attention_select as attention
from tokenbudget.worker.attention_select import flash_attn_problem

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _reference_varlen(q, k, v, *, cu_seqlens_q, max_seqlen_q, causal, **_):
    """A correct flash_attn_varlen_func for the self-check's inputs (SDPA per sequence)."""
    bounds = cu_seqlens_q.tolist()
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=causal
            ).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])
        ]
    )


def _install_fake(monkeypatch, varlen=None, import_error: Exception | None = None):
    if import_error is not None:

        class Failing(types.ModuleType):
            def __getattr__(self, name):
                raise import_error

        module = Failing("flash_attn")
    else:
        module = types.ModuleType("flash_attn")
        module.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def test_self_check_passes_a_correct_flash_attn(monkeypatch):
    calls = []

    def varlen(*args, **kwargs):
        calls.append(kwargs["cu_seqlens_q"].tolist())
        return _reference_varlen(*args, **kwargs)

    _install_fake(monkeypatch, varlen)
    assert flash_attn_problem(CPU, torch.float32) is None
    assert calls == [[0, 2, 5]]  # two sequences packed: the check exercises varlen


def test_self_check_refuses_a_flash_attn_that_imports_but_computes_wrong(monkeypatch):
    # Forgets causality: what a kernel built for another GPU can look like.
    _install_fake(monkeypatch, lambda *a, **kw: _reference_varlen(*a, **{**kw, "causal": False}))
    assert "wrong result" in flash_attn_problem(CPU, torch.float32)


def test_self_check_refuses_a_flash_attn_whose_kernel_raises(monkeypatch):
    def varlen(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution")

    _install_fake(monkeypatch, varlen)
    problem = flash_attn_problem(CPU, torch.float32)
    assert "self-check failed" in problem and "no kernel image" in problem


def test_self_check_refuses_a_flash_attn_that_raises_on_import(monkeypatch):
    _install_fake(
        monkeypatch,
        import_error=ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice"),
    )
    problem = flash_attn_problem(CPU, torch.float32)
    assert "does not import" in problem and "undefined symbol" in problem


@pytest.fixture
def found(monkeypatch):
    """flash-attn is installed (found on the path); ``found(problem)`` sets
    what its self-check says. Triton is absent (test_triton_attention.py
    covers auto's choice of it)."""
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    monkeypatch.setattr(attention, "triton_problem", lambda device: "not installed")

    def set_problem(problem):
        monkeypatch.setattr(attention, "flash_attn_problem", lambda device, dtype: problem)

    return set_problem


def test_auto_picks_flash_attn_only_when_its_self_check_passes(found):
    found(None)
    assert attention.resolve_backend("auto", CUDA, torch.bfloat16) == "flash_attn"
    assert attention.resolve_backend("auto", CUDA, torch.float32) == "sdpa"  # no fp32 kernels
    # On CPU auto picks the cpu kernel or SDPA (test_cpu_attention.py), never flash-attn.
    assert attention.resolve_backend("auto", CPU, torch.bfloat16) in ("cpu", "sdpa")


def test_auto_falls_back_to_sdpa_with_a_warning_when_flash_attn_is_broken(found, caplog):
    found("flash_attn does not import (ImportError: undefined symbol)")
    with caplog.at_level(logging.WARNING, logger="tokenbudget.worker.attention"):
        assert attention.resolve_backend("auto", CUDA, torch.float16) == "sdpa"
    assert "undefined symbol" in caplog.text


def test_asking_for_a_broken_flash_attn_says_why(found):
    found("flash_attn's self-check gave a wrong result (a build for another GPU?)")
    with pytest.raises(ValueError, match="wrong result"):
        attention.resolve_backend("flash_attn", CUDA, torch.float16)
    assert attention.resolve_backend("sdpa", CUDA, torch.float16) == "sdpa"


def test_auto_does_not_run_the_self_check_when_flash_attn_is_not_installed(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    monkeypatch.setattr(attention, "triton_problem", lambda device: "not installed")
    monkeypatch.setattr(
        attention, "flash_attn_problem", lambda device, dtype: pytest.fail("self-check run")
    )
    assert attention.resolve_backend("auto", CUDA, torch.float16) == "sdpa"
    with pytest.raises(ValueError, match="flash-attn package"):
        attention.resolve_backend("flash_attn", CUDA, torch.float16)


@pytest.mark.parametrize(
    "backend,block_size,warns",
    [
        ("flash_attn", 16, True),
        ("flash_attn", 256, False),
        ("flash_attn", 512, False),
        ("sdpa", 16, False),
    ],
)
def test_flash_attn_with_blocks_it_cannot_page_warns_at_kv_allocation(
    tiny_qwen3_path, caplog, backend, block_size, warns
):
    from tokenbudget.core import CacheConfig, SchedulerConfig
    from tokenbudget.worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu")
    # As resolved on a GPU (and asked for: auto would be resolved again); allocation is the same.
    runner.attention_backend = runner.attention_backend_choice = backend
    with caplog.at_level("WARNING"):
        runner.initialize_kv_cache(
            CacheConfig(block_size=block_size, num_blocks=4), SchedulerConfig(max_model_len=64)
        )
    said = [r.getMessage() for r in caplog.records if "block-size" in r.getMessage()]
    assert len(said) == warns
    if warns:
        assert f"with {block_size} each layer gathers" in said[0] and "--block-size 256" in said[0]
