"""Engine arguments: the one set of settings behind ``server``'s flags and
``LLM(...)``'s keywords, under vLLM's names where vLLM has the setting.

Each setting is declared once, as a field with its default, help text and
``server --help`` group (``core.config.setting``); the scheduler's and the KV
cache's settings are SchedulerConfig's and CacheConfig's fields, taken over
with ``_from``. The flags are derived from the fields (``engine_flags`` in
flags.py): a flag ``--max-num-seqs`` is the keyword ``max_num_seqs``. vLLM's
names for settings we had under our own names are aliases (``ALIASES``), as
keywords and as flags. What we cannot honour is refused with
``UnsupportedArgument`` ("not supported: why") before anything loads
(args_checks.py); accepted flags that change nothing here say so in their help.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from tokenbudget.core.config import (
    DEFAULT_MAX_MODEL_LEN,
    KV_CACHE,
    POLICY,
    POLICY_OPTIONS,
    SCHEDULER,
    CacheConfig,
    SchedulerConfig,
    setting,
)
from tokenbudget.core.lora import LORA, LoRAConfig
from tokenbudget.server.engine.disagg.config import DISAGGREGATION, DisaggregationConfig
from tokenbudget.core.spec_config import SpeculativeConfig
from tokenbudget.server.engine.arg_values import (
    parse_memory_size as parse_memory_size,
    read_chat_template as read_chat_template,
)
from tokenbudget.server.engine.args_checks import (
    FP8_KV_CACHE_DTYPES as FP8_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    check_engine_args,
)
from tokenbudget.server.engine.compat import (
    TOKENIZER_MODES,
    UnsupportedArgument as UnsupportedArgument,
    parse_mm_limits,
)
from tokenbudget.core.structured.manager import DEFAULT_GRAMMAR_CACHE_BYTES
from tokenbudget.server.engine.request_limits import RequestLimits
from tokenbudget.worker.cuda_graph_sizes import CudaGraphConfig
from tokenbudget.server.engine.mm_processor import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST,
)

logger = logging.getLogger("tokenbudget.server")

# The ``server --help`` groups, in order (SCHEDULER, POLICY, KV_CACHE: core.config).
MODEL, SERVER, LOGGING, WORKERS = "model", "server", "logging", "workers"
GROUPS = (MODEL, SERVER, LOGGING, WORKERS, SCHEDULER, POLICY, KV_CACHE, LORA, DISAGGREGATION)
# vLLM's name -> ours, for LLM(...) keywords (the CLI has both as option strings).
ALIASES = {
    "num_gpu_blocks_override": "num_gpu_blocks",
    "kv_cache_memory_bytes": "kv_cache_memory",
    "scheduling_policy": "policy",
    "override_pooler_config": "pooler_config",
}


def _from(config: type, name: str, **override: Any) -> Any:
    """The EngineArgs field of ``config``'s setting ``name``, with the default
    and flag declared there (its ``engine_default`` where it has one);
    ``override`` replaces what differs here."""
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    meta = {**f.metadata, **override}
    return field(default=meta.pop("engine_default", f.default), metadata=meta)


@dataclass(slots=True)
class EngineArgs(LoRAConfig):  # LoRAConfig's settings are ours (core/lora.py)
    model: str | None = setting(
        None,
        "Hugging Face checkpoint: a local folder or a hub id. Without it the built-in "
        "tiny demo model (random weights) is served.",
        group=MODEL,
    )
    served_model_name: str | None = setting(
        None,
        "the model name GetModelInfo and the gateway report (default: --model)",
        group=MODEL,
        metavar="NAME",
    )
    tokenizer: str | None = setting(
        None, "tokenizer folder or hub id (default: --model)", group=MODEL, metavar="PATH_OR_ID"
    )
    tokenizer_mode: str = setting(
        "auto",
        "auto: the checkpoint's fast (Rust) tokenizer, the only kind transformers 5 "
        "loads (default; vLLM's slow, mistral and custom modes are refused)",
        group=MODEL,
        choices=TOKENIZER_MODES,
    )
    download_dir: str | None = setting(
        None,
        "download hub checkpoints to and load them from this folder (default: the "
        "Hugging Face cache, $HF_HUB_CACHE)",
        group=MODEL,
        metavar="DIR",
    )
    revision: str | None = setting(
        None,
        "branch, tag or commit of a hub model (and of its tokenizer unless --tokenizer "
        "names another)",
        group=MODEL,
    )
    trust_remote_code: bool = setting(
        False,
        "run the checkpoint's own modelling code (transformers' trust_remote_code)",
        group=MODEL,
    )
    dtype: str = setting(
        "auto",
        "weights and activations (default %(default)s: float32 on CPU; on a GPU the "
        "checkpoint's half dtype, else bfloat16)",
        group=MODEL,
        choices=("auto", "float32", "float16", "bfloat16", "float", "half"),
    )
    seed: int = setting(
        0,
        "seed of the global generator that requests without their own seed draw from "
        "(default %(default)s)",
        group=MODEL,
    )
    chat_template: str | None = setting(
        None,
        "Jinja chat template, a file or the template itself (default: the tokenizer's)",
        group=MODEL,
        metavar="FILE_OR_TEMPLATE",
    )
    generation_config: str = setting(
        "auto",
        "sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) for fields a request leaves unset: auto = the model's "
        "generation_config.json, vllm = none (SamplingParams' own), or a folder holding one "
        "(default %(default)s)",
        group=MODEL,
        metavar="auto|vllm|FOLDER",
    )
    max_logprobs: int = setting(
        20,
        "the most logprobs / prompt_logprobs a request may ask for; -1 = the vocabulary "
        "(default %(default)s)",
        group=MODEL,
    )
    # PoolerConfig fields as a dict or JSON text.
    pooler_config: dict | str | None = setting(
        None,
        'embedding requests\' default pooling, e.g. \'{"pooling_type": "MEAN", '
        '"normalize": false}\': pooling_type LAST, MEAN or CLS, normalize (L2) true or false; '
        "a field left out comes from the model (its sentence-transformers modules.json, else "
        "LAST with normalize for decoders). Requests may override both "
        "(--override-pooler-config is vLLM's older name)",
        group=MODEL,
        metavar="JSON",
    )
    # None: compiled on CUDA, eager on CPU (worker/compiled.py eager_by_default).
    enforce_eager: bool | None = setting(
        None,
        "run the model op by op: no compiled decoder (torch.compile with inductor, which "
        "fuses norms, rotary and activations and prepacks CPU linears; compiled once at "
        "start-up, 10-30 s cold on 2 CPU cores, a few seconds from inductor's on-disk cache, "
        "$TORCHINDUCTOR_CACHE_DIR) and no CUDA graphs. Default: compiled on CUDA, eager on "
        "CPU; --no-enforce-eager compiles on CPU too",
        group=MODEL,
    )
    device: str | None = setting(
        None, "cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)", group=MODEL
    )
    attention_backend: str = setting(
        "auto",
        "paged attention kernel (default %(default)s: the fastest available; cpu: our C++ "
        "kernel reading the paged cache in place, built on first use with g++, else sdpa; "
        "cuda: flash_attn when its pages fit --block-size (multiples of 256), else triton: "
        "a Triton kernel reading the paged cache in place at any power-of-two block size)",
        group=MODEL,
        choices=("auto", "sdpa", "flash_attn", "cpu", "triton"),
    )
    # Decode CUDA graphs (worker/cuda_graph_sizes.py).
    cuda_graph_sizes: list[int] | str | None = _from(CudaGraphConfig, "cuda_graph_sizes")
    cuda_graph_max_bs: int | None = _from(CudaGraphConfig, "cuda_graph_max_bs")
    # -- input limits (one client must not exhaust the server's memory) --
    max_image_pixels: int = setting(
        DEFAULT_MAX_IMAGE_PIXELS,
        "an image with more pixels (width x height, read from its "
        "header before decoding) is refused with INVALID_ARGUMENT (default %(default)s = "
        "4096x4096; decoding costs about 10 bytes a pixel; the model's image processor then "
        "resizes to its own max_pixels)",
        group=SERVER,
    )
    max_image_pixels_per_request: int = setting(
        DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST,
        "a request whose images add up to more pixels is "
        "refused before any is decoded (default %(default)s)",
        group=SERVER,
    )
    limit_mm_per_prompt: dict[str, int] | None = setting(
        None,
        "the most items of each modality one prompt may carry, as vLLM's JSON, e.g. "
        "'{\"image\": 2}'; a prompt with more is refused (INVALID_ARGUMENT). Images are the "
        "only modality served (default: no limit but the pixel limits)",
        group=SERVER,
        metavar="JSON",
        parse=parse_mm_limits,
    )
    # None: InputProcessor.max_prompt_bytes.
    max_prompt_bytes: int | None = setting(
        None,
        "a text prompt (after its chat template) longer than this in UTF-8 bytes is "
        "refused before tokenizing; with truncate_prompt_tokens only its tail is tokenized "
        "(default: --max-model-len x the tokenizer's longest token in bytes, x3 when it "
        "normalizes Unicode: a text that can never fit)",
        group=SERVER,
    )
    # Stop strings, bad words and structured specs (server/engine/request_limits.py).
    max_stop_strings: int = _from(RequestLimits, "max_stop_strings")
    max_stop_string_bytes: int = _from(RequestLimits, "max_stop_string_bytes")
    max_bad_words: int = _from(RequestLimits, "max_bad_words")
    max_bad_word_bytes: int = _from(RequestLimits, "max_bad_word_bytes")
    max_structured_bytes: int = _from(RequestLimits, "max_structured_bytes")
    grammar_cache_bytes: int = setting(
        DEFAULT_GRAMMAR_CACHE_BYTES,
        "compiled structured-output grammars kept for reuse, in "
        "bytes; least recently used go first (default %(default)s = 512 MiB)",
        group=SERVER,
    )
    grammar_compile_timeout_s: float = setting(
        30.0,
        "a structured-output grammar not compiled in this time fails its request with "
        "DEADLINE_EXCEEDED (default %(default)s)",
        group=SERVER,
    )
    # -- logging --
    disable_log_stats: bool = setting(
        False, "no periodic stats line (as --log-stats-interval 0)", group=LOGGING
    )
    enable_log_requests: bool = setting(
        False,
        "log one line per finished request at info level (without it: at debug level)",
        group=LOGGING,
    )
    tensor_parallel_size: int = setting(
        1,
        "shard the model over N worker processes started on this host (torch.distributed: "
        "gloo on CPU, NCCL on CUDA; default %(default)s). For several hosts, start `python -m "
        "tokenbudget.worker --rank R --world-size N --dist-init tcp://HOST:PORT` on each and "
        "give rank 0's address to --worker",
        group=WORKERS,
        flags=("-tp",),
        metavar="N",
    )
    # -- scheduler (SchedulerConfig's settings; its policy options are policy_options) --
    max_num_batched_tokens: int = _from(SchedulerConfig, "max_num_batched_tokens")
    max_num_seqs: int = _from(SchedulerConfig, "max_num_seqs")
    # None: the model's, at most DEFAULT_MAX_MODEL_LEN (resolve_max_model_len).
    max_model_len: int | None = _from(SchedulerConfig, "max_model_len", engine_default=None)
    long_prefill_token_threshold: int = _from(SchedulerConfig, "long_prefill_token_threshold")
    policy: str = _from(SchedulerConfig, "policy")
    async_scheduling: bool = _from(SchedulerConfig, "async_scheduling")
    enable_chunked_prefill: bool = setting(
        True,
        "prompts longer than a step's budget are split into chunks: always on "
        "(--no-enable-chunked-prefill is refused)",
        group=SCHEDULER,
    )
    max_num_partial_prefills: int = setting(
        1,
        "prompts partially prefilled at once: 1, what the scheduler does (other values are "
        "refused)",
        group=SCHEDULER,
    )
    encoder_compute_budget: int = _from(SchedulerConfig, "encoder_compute_budget")
    encoder_cache_size: int = _from(SchedulerConfig, "encoder_cache_size")
    # vLLM's dict (or its JSON text).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = _from(
        SchedulerConfig, "speculative_config"
    )
    # The SGLang-style options of SchedulerConfig (core.config.POLICY_OPTIONS).
    policy_options: dict[str, Any] = field(default_factory=dict)
    # -- KV cache (CacheConfig's settings, under vLLM's names) --
    block_size: int = _from(CacheConfig, "block_size")
    enable_prefix_caching: bool = _from(CacheConfig, "enable_prefix_caching")
    num_gpu_blocks: int | None = _from(CacheConfig, "num_blocks")
    kv_cache_dtype: str = setting(
        "auto",
        "auto (default): the model's dtype, the only one the cache is kept in; naming "
        "that dtype is accepted, others and fp8 are refused",
        group=KV_CACHE,
        choices=KV_CACHE_DTYPES,
    )
    # Bytes, or a size such as "2GiB" (parse_memory_size).
    kv_cache_memory: int | str | None = _from(CacheConfig, "kv_cache_memory_bytes")
    gpu_memory_utilization: float = _from(CacheConfig, "gpu_memory_utilization")
    hash_algo: str = _from(CacheConfig, "hash_algo")
    hash_seed: int | None = _from(CacheConfig, "hash_seed")
    kv_offload_memory: int | str | None = _from(CacheConfig, "kv_offload_memory_bytes")
    num_offload_blocks: int | None = _from(CacheConfig, "num_offload_blocks")
    kv_load_blocks_per_step: int = _from(CacheConfig, "kv_load_blocks_per_step")
    enable_kv_cache_events: bool = _from(CacheConfig, "enable_kv_cache_events")
    # -- disaggregated prefill/decode (DisaggregationConfig's settings) --
    disaggregation_mode: str = _from(DisaggregationConfig, "disaggregation_mode")
    disaggregation_bootstrap_port: int = _from(
        DisaggregationConfig, "disaggregation_bootstrap_port"
    )
    disaggregation_transfer_backend: str = _from(
        DisaggregationConfig, "disaggregation_transfer_backend"
    )
    disaggregation_timeout: float = _from(DisaggregationConfig, "disaggregation_timeout")
    kv_transfer_config: dict[str, Any] | str | None = _from(
        DisaggregationConfig, "kv_transfer_config"
    )

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
                raise ValueError(
                    f"{given_as[name]} and {key} name the same setting; give "
                    f"one (got {target[name]!r} and {value!r})"
                )
            target[name], given_as[name] = value, key
        args = cls(model=model, policy_options=policy_options, **values)
        args.check()
        return args

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        given = vars(ns)
        names = {f.name for f in dataclasses.fields(cls)} - {"policy_options"}
        args = cls(
            policy_options={n: given[n] for n in POLICY_OPTIONS if n in given},
            **{n: given[n] for n in names if n in given},
        )
        args.check()
        return args

    def check(self) -> None:
        """Refuse what cannot be honoured, naming it and saying why."""
        check_engine_args(self)
        # vLLM's JSON text parsed (and every disaggregation flag checked) once, here.
        self.kv_transfer_config = self.disaggregation_config.kv_transfer_config

    @property
    def disaggregation_config(self) -> DisaggregationConfig:
        """The disaggregation settings on their own (checked on construction)."""
        return DisaggregationConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(DisaggregationConfig)}
        )

    def max_logprobs_for(self, vocab_size: int) -> int:
        return vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def input_limits(self, max_model_len: int) -> dict[str, Any]:
        """InputProcessor keywords: the context and the prompt and image limits."""
        return {
            "max_model_len": max_model_len,
            "max_prompt_bytes": self.max_prompt_bytes,
            "max_image_pixels": self.max_image_pixels,
            "max_image_pixels_per_request": self.max_image_pixels_per_request,
            "max_images_per_prompt": (self.limit_mm_per_prompt or {}).get("image"),
            "request_limits": RequestLimits(
                **{f: getattr(self, f) for f in RequestLimits.__dataclass_fields__}
            ),
        }

    def structured_output_manager(self, tokenizer: Any, vocab_size: int, **options: Any):
        """The StructuredOutputManager with these settings (xgrammar loads on first use)."""
        from tokenbudget.core.structured.manager import StructuredOutputManager

        return StructuredOutputManager(
            tokenizer,
            vocab_size,
            compile_timeout_s=self.grammar_compile_timeout_s,
            cache_bytes=self.grammar_cache_bytes,
            **options,
        )

    def resolve_max_model_len(self, text_config) -> int:
        """The model's context limit (at most 8192 by default). A sliding window
        does not cap it: each window has its own KV cache group (worker/kv_groups.py)."""
        limit = getattr(text_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        why = f"the model's max_position_embeddings={limit}"
        if self.max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds {why}")
        return self.max_model_len

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SchedulerConfig)
            if f.name not in POLICY_OPTIONS
        }
        return SchedulerConfig(**{**given, "max_model_len": max_model_len}, **self.policy_options)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_gpu_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=parse_memory_size(self.kv_cache_memory),
            gpu_memory_utilization=self.gpu_memory_utilization,
            hash_algo=self.hash_algo,
            hash_seed=self.hash_seed,
            kv_offload_memory_bytes=parse_memory_size(self.kv_offload_memory, "kv_offload_memory"),
            num_offload_blocks=self.num_offload_blocks,
            kv_load_blocks_per_step=self.kv_load_blocks_per_step,
            enable_kv_cache_events=self.enable_kv_cache_events,
        )

    def read_chat_template(self) -> str | None:
        return read_chat_template(self.chat_template)
