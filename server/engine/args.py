"""Engine arguments: the one set of settings behind ``server``'s flags and
``LLM(...)``'s keywords, under vLLM's names where vLLM has the setting.

A flag ``--max-num-seqs`` is the keyword ``max_num_seqs``. vLLM's names for
settings we had under our own names are aliases (``ALIASES``). What we cannot
honour is refused with ``UnsupportedArgument`` ("not supported: why") before
anything loads; accepted flags that change nothing here (``enforce_eager``:
we capture no graphs) say so in their help.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tokenbudget.core.config import POLICY_OPTIONS, CacheConfig, SchedulerConfig
from tokenbudget.core.spec_config import SpeculativeConfig
from tokenbudget.core.pooling_params import PoolerConfig
from tokenbudget.core.structured.manager import DEFAULT_GRAMMAR_CACHE_BYTES
from tokenbudget.server.engine.mm_processor import (DEFAULT_MAX_IMAGE_PIXELS,
                                             DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST)

logger = logging.getLogger("tokenbudget.server")

DEFAULT_MAX_MODEL_LEN = 8192
# vLLM's name -> ours, for LLM(...) keywords (the CLI has both as option strings).
ALIASES = {"num_gpu_blocks_override": "num_gpu_blocks",
           "kv_cache_memory_bytes": "kv_cache_memory",
           "scheduling_policy": "policy",
           "override_pooler_config": "pooler_config"}
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", *FP8_KV_CACHE_DTYPES)


class UnsupportedArgument(ValueError):
    """An engine argument vLLM has whose value tokenbudget cannot honour."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name} is not supported: {why}")


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None
    # The name GetModelInfo and the gateway report (default: model).
    served_model_name: str | None = None
    tokenizer: str | None = None           # default: model
    revision: str | None = None            # of the model and, by default, its tokenizer
    trust_remote_code: bool = False
    dtype: str = "auto"
    device: str | None = None
    attention_backend: str = "auto"
    # Ranks one model is sharded over (worker processes started on this host).
    tensor_parallel_size: int = 1
    # Seeds torch's global generator (requests without a seed of their own).
    seed: int = 0
    # A Jinja template, inline or the path of a file holding one.
    chat_template: str | None = None
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm"
    # (none: SamplingParams' own defaults) or a folder holding one.
    generation_config: str = "auto"
    # The most logprobs / prompt_logprobs a request may ask for; -1: the vocabulary.
    max_logprobs: int = 20
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False            # we never capture CUDA graphs: eager always
    enable_chunked_prefill: bool = True    # the scheduler always chunks
    max_num_partial_prefills: int = 1
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    # Embedding requests' default pooling over the model's own (PoolerConfig
    # fields as a dict or JSON text: pooling_type LAST|MEAN|CLS, normalize).
    pooler_config: dict | str | None = None
    # -- scheduler --
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None       # default: the model's, at most 8192
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # On for LLM and server alike: step N+1 is scheduled while step N runs
    # (same tokens as off; the server measured it faster).
    async_scheduling: bool = True
    # Vision encoder budget per step and encoder cache size, in embeddings.
    encoder_compute_budget: int = 8192
    encoder_cache_size: int = 8192
    # Speculative decoding, vLLM's dict (or its JSON text); None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    grammar_compile_timeout_s: float = 30.0
    # Compiled grammars kept for reuse, in bytes.
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    # -- input limits (one client must not exhaust the server's memory) --
    # Pixels of one image / of a request's images, checked from the file
    # headers before decoding.
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_pixels_per_request: int = DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST
    # UTF-8 bytes of a text prompt tokenized at most; None: max_model_len x
    # the tokenizer's longest token (InputProcessor.max_prompt_bytes).
    max_prompt_bytes: int | None = None
    # The SGLang-style options of SchedulerConfig (core.config.POLICY_OPTIONS).
    policy_options: dict[str, Any] = field(default_factory=dict)
    # -- KV cache --
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Prefix-cache block hashes: "sha256" or "xxhash" (faster; the fast-hash extra).
    hash_algo: str = "sha256"
    # xxhash's seed (None: random per process); see CacheConfig.hash_seed.
    hash_seed: int | None = None
    # The host-memory KV tier: a size like "8GiB", or a number of blocks.
    kv_offload_memory: int | str | None = None
    num_offload_blocks: int | None = None
    kv_load_blocks_per_step: int = 256
    enable_kv_cache_events: bool = False

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> EngineArgs:
        """``LLM(model, **kwargs)``: vLLM's aliases and the policy options accepted."""
        values: dict[str, Any] = {}
        policy_options: dict[str, Any] = {}
        given_as: dict[str, str] = {}  # setting -> the keyword that gave it
        names = {f.name for f in dataclasses.fields(cls)} - {"policy_options", "model"}
        for key, value in kwargs.items():
            name = ALIASES.get(key, key)
            target = policy_options if name in POLICY_OPTIONS else values
            if name not in names and name not in POLICY_OPTIONS:
                raise TypeError(f"LLM() got an unknown engine argument {key!r}")
            if name in target and target[name] != value:
                raise ValueError(f"{given_as[name]} and {key} name the same setting; give "
                                 f"one (got {target[name]!r} and {value!r})")
            target[name], given_as[name] = value, key
        args = cls(model=model, policy_options=policy_options, **values)
        args.check()
        return args

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        given = vars(ns)
        names = {f.name for f in dataclasses.fields(cls)} - {"policy_options"}
        args = cls(policy_options={n: given[n] for n in POLICY_OPTIONS if n in given},
                   **{n: given[n] for n in names if n in given})
        args.check()
        return args

    def check(self) -> None:
        """Refuse what cannot be honoured, naming it and saying why."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            # The ranks are told what a remote worker is told (worker.proto Initialize).
            for name, given in (("revision", self.revision is not None),
                                ("trust_remote_code", self.trust_remote_code),
                                ("kv_cache_dtype", self.kv_cache_dtype != "auto")):
                if given:
                    raise UnsupportedArgument(
                        f"{name} with tensor_parallel_size > 1", "the ranks are told only the "
                        "model path, dtype, device and attention backend; give the model as a "
                        "local folder")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            raise UnsupportedArgument(
                f"kv_cache_dtype={self.kv_cache_dtype!r}", "the attention kernels (torch SDPA, "
                "flash-attn varlen) read K/V in the model's dtype, and there are no fp8 "
                "attention kernels on CPU; use 'auto'")
        if not self.enable_chunked_prefill:
            raise UnsupportedArgument(
                "enable_chunked_prefill=False", "the token-budget scheduler always splits a "
                "prompt longer than the step's budget into chunks; to run short prompts "
                "whole, raise max_num_batched_tokens")
        if self.max_num_partial_prefills != 1:
            raise UnsupportedArgument(
                f"max_num_partial_prefills={self.max_num_partial_prefills}", "the scheduler "
                "admits one partially prefilled prompt at a time (vLLM's default, 1); "
                "long_prefill_token_threshold caps one prompt's chunk instead")
        if self.generation_config not in ("auto", "vllm") and \
                not os.path.isdir(os.path.expanduser(self.generation_config)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                             f"generation_config.json, got {self.generation_config!r}")
        PoolerConfig.overrides(self.pooler_config)
        if self.hash_algo == "xxhash":
            try:
                import xxhash  # noqa: F401
            except ImportError:
                raise ValueError("hash_algo='xxhash' needs the xxhash package, which is not "
                                 "installed: pip install 'tokenbudget[fast-hash]', or use "
                                 "hash_algo='sha256'") from None
        self.cache_config()  # sizes and KV tier settings, checked before anything loads
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        for name in ("max_image_pixels", "max_image_pixels_per_request", "max_prompt_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got "
                             f"{self.grammar_compile_timeout_s}")
        if self.enforce_eager:
            logger.debug("enforce_eager: tokenbudget never captures CUDA graphs (always eager)")

    def max_logprobs_for(self, vocab_size: int) -> int:
        return vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def input_limits(self, max_model_len: int) -> dict[str, Any]:
        """InputProcessor keywords: the context and the prompt and image limits."""
        return {"max_model_len": max_model_len, "max_prompt_bytes": self.max_prompt_bytes,
                "max_image_pixels": self.max_image_pixels,
                "max_image_pixels_per_request": self.max_image_pixels_per_request}

    def structured_output_manager(self, tokenizer: Any, vocab_size: int):
        """The StructuredOutputManager with these settings (xgrammar loads on first use)."""
        from tokenbudget.core.structured.manager import StructuredOutputManager

        return StructuredOutputManager(tokenizer, vocab_size,
                                       compile_timeout_s=self.grammar_compile_timeout_s,
                                       cache_bytes=self.grammar_cache_bytes)

    def resolve_max_model_len(self, text_config) -> int:
        """The model's context limit (at most 8192 by default); a sliding window
        caps it, since the paged attention computes full attention, which
        equals the window's only up to the window's width."""
        from tokenbudget.worker.loader import sliding_window

        limit = getattr(text_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        why = f"the model's max_position_embeddings={limit}"
        window = sliding_window(text_config)
        if window is not None and window < limit:
            limit = window
            why = (f"the model's sliding window of {window} tokens (attention is exact only "
                   "within one window until a hybrid KV cache exists)")
        if self.max_model_len is None:
            if limit < DEFAULT_MAX_MODEL_LEN and window == limit:
                logger.warning("max_model_len capped at %d: %s", limit, why)
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds {why}")
        return self.max_model_len

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold, policy=self.policy,
            encoder_compute_budget=self.encoder_compute_budget,
            encoder_cache_size=self.encoder_cache_size,
            speculative_config=self.speculative_config,
            async_scheduling=self.async_scheduling, **self.policy_options)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size, num_blocks=self.num_gpu_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=parse_memory_size(self.kv_cache_memory),
            gpu_memory_utilization=self.gpu_memory_utilization, hash_algo=self.hash_algo,
            hash_seed=self.hash_seed,
            kv_offload_memory_bytes=parse_memory_size(self.kv_offload_memory, "kv_offload_memory"),
            num_offload_blocks=self.num_offload_blocks,
            kv_load_blocks_per_step=self.kv_load_blocks_per_step,
            enable_kv_cache_events=self.enable_kv_cache_events)

    def read_chat_template(self) -> str | None:
        return read_chat_template(self.chat_template)


def read_chat_template(template: str | None) -> str | None:
    """A chat template given inline or as the path of a file (vLLM's rule: an
    existing file is read, anything else is the template itself)."""
    if template is None:
        return None
    path = os.path.expanduser(template)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{" not in template:
        raise ValueError(f"chat_template: {template!r} is neither a file nor a Jinja template")
    return template


def parse_memory_size(value: int | str | None, name: str = "kv_cache_memory") -> int | None:
    """``1073741824``, ``"1GiB"``, ``"512MB"``, ``"2g"`` -> bytes."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", str(value).lower())
    if not m:
        raise ValueError(f"{name} must be a byte count or a size like '2GiB', got {value!r}")
    number, unit, suffix = m.groups()
    base = 1000 if suffix == "b" else 1024
    return int(float(number) * base ** " kmgt".index(unit or " "))
