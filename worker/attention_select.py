"""Which paged-attention backend runs: ``resolve_backend`` and the checks it
makes (flash-attn present, working, and reading pages in place)."""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from tokenbudget.worker.attention import _FLASH_PAGE_MULTIPLE

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "flash_attn")


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
        f"but caches prefixes only in {_FLASH_PAGE_MULTIPLE}-token blocks"
    )


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The attention backend to run: ``auto`` picks flash-attn only on CUDA in
    half precision when it imports and passes a tiny self-check
    (flash_attn_problem), else SDPA with a warning saying why."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "sdpa":
        return name
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
    logger.warning("attention: using SDPA, not flash-attn: %s", problem)
    return "sdpa"
