"""Which paged-attention backend runs: ``resolve_backend`` and the checks it
makes (flash-attn present, working, and reading pages in place; triton
importable and on a device it can run on)."""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from tokenbudget.worker.attention import _FLASH_PAGE_MULTIPLE

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "flash_attn", "triton", "cpu")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash-attn cannot be used on ``device`` in ``dtype``, or None when
    it imports and one tiny causal varlen call matches SDPA. A package that is
    merely installed is not enough: a build for another torch or CUDA fails at
    import (undefined symbols) or at its first kernel launch."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # ImportError, OSError, or whatever a broken build raises
        return f"flash_attn does not import ({type(exc).__name__}: {exc})"
    try:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(5, 2, 16, generator=gen).to(device, dtype) for _ in range(3))
        cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
        got = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3, causal=True
        )
        want = torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1).float() for t in (q, k, v)), is_causal=True
                ).transpose(0, 1)
                for a, b in ((0, 2), (2, 5))
            ]
        )
        if not torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2):
            return "flash_attn's self-check gave a wrong result (a build for another GPU?)"
    except Exception as exc:
        return f"flash_attn's self-check failed ({type(exc).__name__}: {exc})"
    return None


def triton_problem(device: torch.device) -> str | None:
    """Why the triton backend cannot run on ``device``, or None."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # a triton built for another torch or Python
        return f"triton does not import ({type(exc).__name__}: {exc})"
    if device.type == "cuda":
        return None
    # TRITON_INTERPRET=1 is triton's own switch, read when a kernel is
    # wrapped; its CPU interpreter is for tests (slow, but exact).
    if device.type == "cpu" and triton.knobs.runtime.interpret:
        return None
    return (
        f"triton kernels run on CUDA devices, not {device.type} (on CPU only in "
        "triton's interpreter, with TRITON_INTERPRET=1, for tests)"
    )


def flash_block_size_warning(backend: str, block_size: int) -> str | None:
    """Why flash-attn will copy KV at this block size, or None.

    The default block size stays 16 with flash-attn: prefix-cache hits come in
    whole blocks, and pages of 256 would share prompts only at 256-token
    boundaries and waste up to 255 slots per request. The price is a gather
    of each request's context per layer, which long contexts feel: the
    warning tells users where the choice lies."""
    if backend != "flash_attn" or block_size % _FLASH_PAGE_MULTIPLE == 0:
        return None
    return (
        f"flash-attn reads the paged KV cache in place only with --block-size a multiple "
        f"of {_FLASH_PAGE_MULTIPLE}; with {block_size} each layer gathers every "
        f"request's context first. --block-size {_FLASH_PAGE_MULTIPLE} avoids the copy "
        f"but caches prefixes only in {_FLASH_PAGE_MULTIPLE}-token blocks; "
        "--attention-backend triton reads pages of any size in place"
    )


def resolve_backend(
    name: str, device: torch.device, dtype: torch.dtype, *, block_size: int | None = None
) -> str:
    """The attention backend to run. ``auto`` on CUDA picks flash-attn in half
    precision when it imports, passes a tiny self-check (flash_attn_problem)
    and reads pages of ``block_size`` in place (a multiple of 256; None: not
    known yet); else triton when it works there (triton_problem); else SDPA,
    with a warning when flash-attn is broken. On CPU see _resolve_cpu."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "sdpa":
        return name
    if name == "triton":
        problem = triton_problem(device)
        if problem:
            raise ValueError(f"attention_backend='triton': {problem}; use 'sdpa' or 'auto'")
        return name
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _resolve_cpu(name, device, dtype)
    if name == "auto" and device.type == "cuda":
        flash = _resolve_flash("auto", device, dtype)
        in_place = block_size is None or block_size % _FLASH_PAGE_MULTIPLE == 0
        if (flash == "sdpa" or not in_place) and triton_problem(device) is None:
            return "triton"
        return flash
    return _resolve_flash(name, device, dtype)


def _resolve_cpu(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``cpu`` (our C++ kernel, worker/attention_cpu.py) when it builds and
    passes its self-check; ``auto`` falls back to SDPA saying why."""
    from tokenbudget.worker.attention_cpu import DTYPES, cpu_kernel_problem

    if device.type != "cpu" or dtype not in DTYPES:
        problem = f"it runs on CPU in float32 or bfloat16, not {device.type} {dtype}"
    else:
        problem = cpu_kernel_problem()
    if problem is None:
        return "cpu"
    if name == "cpu":
        raise ValueError(f"attention_backend='cpu': {problem}; use 'sdpa' or 'auto'")
    logger.warning("attention: using SDPA, not the cpu kernel: %s", problem)
    return "sdpa"


def _resolve_flash(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """resolve_backend for ``flash_attn`` and ``auto`` without triton."""
    # flash-attn kernels exist only for CUDA and half precision.
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        if name == "auto":
            return "sdpa"
        raise ValueError(
            "attention_backend='flash_attn' needs a CUDA device and dtype float16 "
            "or bfloat16; use 'sdpa' or 'auto'"
        )
    if not flash_attn_available():
        if name == "auto":
            return "sdpa"
        raise ValueError(
            "attention_backend='flash_attn' needs the flash-attn package (pip "
            "install tokenbudget[gpu]); use 'sdpa' or 'auto'"
        )
    problem = flash_attn_problem(device, dtype)
    if problem is None:
        return "flash_attn"
    if name == "flash_attn":
        raise ValueError(f"attention_backend='flash_attn': {problem}; use 'sdpa' or 'auto'")
    logger.warning("attention: not using flash-attn: %s", problem)
    return "sdpa"
