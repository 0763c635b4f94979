"""EngineArgs' checks (EngineArgs.check): what cannot be honoured is refused
before anything loads, naming the setting and saying why (``UnsupportedArgument``
for vLLM settings whose value tokenbudget cannot honour, ValueError for values
out of range)."""

from __future__ import annotations

import logging
import os
from typing import Any

from tokenbudget.core.pooling_params import PoolerConfig
from tokenbudget.core.spec_config import SpeculativeConfig
from tokenbudget.server.engine.compat import UnsupportedArgument, check_compat
from tokenbudget.worker.cuda_graph_sizes import capture_sizes

logger = logging.getLogger("tokenbudget.server")

FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", *FP8_KV_CACHE_DTYPES)


def check_engine_args(args: Any) -> None:
    """Refuse what ``args`` (EngineArgs, normalized in place) cannot honour,
    naming it and saying why."""
    _refuse_unsupported(args)
    _check_values(args)


def _refuse_unsupported(args: Any) -> None:
    """The settings vLLM has whose values the scheduler, the KV cache or the
    tensor-parallel ranks cannot honour."""
    if args.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1:
        # The ranks are told what a remote worker is told (worker.proto Initialize).
        for name, given in (
            ("revision", args.revision is not None),
            ("trust_remote_code", args.trust_remote_code),
            ("kv_cache_dtype", args.kv_cache_dtype != "auto"),
        ):
            if given:
                raise UnsupportedArgument(
                    f"{name} with tensor_parallel_size > 1",
                    "the ranks are told only the model path, dtype, device, "
                    "attention backend and LoRA settings; give the model as a local folder",
                )
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {args.kv_cache_dtype!r}"
        )
    if args.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        raise UnsupportedArgument(
            f"kv_cache_dtype={args.kv_cache_dtype!r}",
            "the attention kernels (torch SDPA, "
            "flash-attn varlen) read K/V in the model's dtype, and there are no fp8 "
            "attention kernels on CPU; use 'auto'",
        )
    if not args.enable_chunked_prefill:
        raise UnsupportedArgument(
            "enable_chunked_prefill=False",
            "the token-budget scheduler always splits a "
            "prompt longer than the step's budget into chunks; to run short prompts "
            "whole, raise max_num_batched_tokens",
        )
    if args.max_num_partial_prefills != 1:
        raise UnsupportedArgument(
            f"max_num_partial_prefills={args.max_num_partial_prefills}",
            "the scheduler "
            "admits one partially prefilled prompt at a time (vLLM's default, 1); "
            "long_prefill_token_threshold caps one prompt's chunk instead",
        )


def _check_values(args: Any) -> None:
    """The remaining settings: in range, parseable, their packages installed."""
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(
        os.path.expanduser(args.generation_config)
    ):
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder holding "
            f"generation_config.json, got {args.generation_config!r}"
        )
    PoolerConfig.overrides(args.pooler_config)
    check_compat(args)
    if args.hash_algo == "xxhash":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise ValueError(
                "hash_algo='xxhash' needs the xxhash package, which is not "
                "installed: pip install 'tokenbudget[fast-hash]', or use "
                "hash_algo='sha256'"
            ) from None
    args.cache_config()  # sizes and KV tier settings, checked before anything loads
    # One list of sizes from either spelling (idempotent: max_bs is folded in).
    args.cuda_graph_sizes = list(capture_sizes(args.cuda_graph_sizes, args.cuda_graph_max_bs))
    args.cuda_graph_max_bs = None
    if args.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be >= -1, got {args.max_logprobs}")
    args.speculative_config = SpeculativeConfig.parse(args.speculative_config)
    for name in ("max_image_pixels", "max_image_pixels_per_request", "max_prompt_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.grammar_cache_bytes < 0:
        raise ValueError(f"grammar_cache_bytes must be >= 0, got {args.grammar_cache_bytes}")
    if args.grammar_compile_timeout_s <= 0:
        raise ValueError(
            f"grammar_compile_timeout_s must be > 0, got {args.grammar_compile_timeout_s}"
        )
