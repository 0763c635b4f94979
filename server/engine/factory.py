"""The one place an engine is assembled from ``EngineArgs``: the model's
config, the input processor and the defaults the checkpoint brings, the
executor (in this process, tensor-parallel ranks started here, or remote
workers), the scheduler and cache configs, the structured-output manager, a
disaggregated prefill's or decode's KV connector, and the EngineCore over
them. ``LLM`` takes the core; ``server`` wraps it in an AsyncEngine. The
model must be given: ``server`` resolves its demo model first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenbudget.core.config import CacheConfig
from tokenbudget.core.kv.connector import PREFILL, KVConnector
from tokenbudget.core.outputs import KVCacheSpec
from tokenbudget.core.pooling_params import PoolerConfig
from tokenbudget.core.structured.manager import StructuredOutputManager
from tokenbudget.server.engine.args import EngineArgs, UnsupportedArgument
from tokenbudget.server.engine.async_engine import AsyncEngine
from tokenbudget.server.engine.compat import use_download_dir
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.server.engine.generation_defaults import (
    GenerationDefaults,
    load_generation_defaults,
)
from tokenbudget.server.engine.input_processor import InputProcessor
from tokenbudget.server.engine.lora_registry import LoRARegistry
from tokenbudget.server.engine.pooler_defaults import load_pooler_config
from tokenbudget.worker.cuda_graph_sizes import DEFAULT_CAPTURE_SIZES

logger = logging.getLogger("tokenbudget.server")
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the model runs, beyond EngineArgs: the ``server`` flags of its
    workers group. Without one (``LLM``) it runs in this process, or on
    ``tensor_parallel_size`` ranks started here with the executors' defaults."""

    workers: tuple[str, ...]  # remote workers (HOST:PORT); empty: this host
    secret: str | None  # the workers' shared secret
    max_message_size: int  # of the worker stream, in bytes
    connect_timeout: float  # seconds a remote worker has to accept
    step_timeout: float  # seconds before a silent worker is hung; 0: never
    torch_threads: int | None  # per tensor-parallel rank; None: a share of this host's
    # Once a worker answered steps: the tighter hang bound (RemoteExecutor); 0: off.
    hang_timeout: float = 0.0
    # The server's --host: a prefill's KV bootstrap listener binds to it.
    host: str = LOOPBACK


@dataclass(slots=True)
class EngineParts:
    """What ``build_engine_core`` assembled: the core and what a front needs beside it."""

    core: EngineCore
    hf_config: Any
    input_processor: InputProcessor
    generation_defaults: GenerationDefaults
    pooler_config: PoolerConfig
    structured_output: StructuredOutputManager


def build_engine_core(
    args: EngineArgs,
    placement: Placement | None = None,
    *,
    before_load: Callable[[], None] | None = None,
    stoppable_compiles: bool = False,
) -> EngineParts:
    """Load ``args.model`` and build its engine. Everything that can be
    refused without the weights is refused first; ``before_load`` runs just
    before they load (the server checks its port there). ``stoppable_compiles``:
    grammars compile in child processes killed at their timeout (for servers)."""
    from tokenbudget.core.utils.model_source import load_config
    from tokenbudget.worker.loader import check_supported

    model = args.model
    if model is None:
        raise ValueError("EngineArgs.model is required to build an engine")
    use_download_dir(args.download_dir)
    hf_config = load_config(model, revision=args.revision, trust_remote_code=args.trust_remote_code)
    check_supported(hf_config, model)
    text_config = hf_config.get_text_config()
    vocab_size = text_config.vocab_size
    max_model_len = args.resolve_max_model_len(text_config)
    scheduler_config, cache_config = args.scheduler_config(max_model_len), args.cache_config()
    kv_connector_factory = None
    if args.disaggregation_config.enabled:
        cache_config = _disaggregated_cache(args, text_config, cache_config, placement)
        kv_connector_factory = _kv_connector_factory(args, placement, cache_config.block_size)
    input_processor = _input_processor(args, vocab_size, max_model_len)
    defaults = load_generation_defaults(
        model,
        source=args.generation_config,
        revision=args.revision,
        tokenizer_eos_token_id=input_processor.eos_token_id,
    )
    pooler_config = load_pooler_config(model, args.pooler_config, revision=args.revision)
    if before_load is not None:
        before_load()
    # Cheap until a structured request arrives (xgrammar loads then).
    stoppable = {"compile_in_process": stoppable_compiles}
    structured = args.structured_output_manager(input_processor.tokenizer, vocab_size, **stoppable)
    core = EngineCore(
        scheduler_config,
        cache_config,
        make_executor(args, placement),
        structured,
        max_model_len_given=args.max_model_len is not None,
        lora_config=args.lora_config,
        kv_connector_factory=kv_connector_factory,
    )
    logger.info(
        "KV cache: %d blocks of %d tokens; async scheduling %s",
        core.cache_config.num_blocks,
        core.cache_config.block_size,
        "on" if args.async_scheduling else "off",
    )
    return EngineParts(core, hf_config, input_processor, defaults, pooler_config, structured)


def _disaggregated_cache(
    args: EngineArgs, text_config, cache_config: CacheConfig, placement: Placement | None
) -> CacheConfig:
    """``cache_config`` with the workers told to register their KV with the
    transfer backend; what disaggregation cannot serve yet, or a prefill's
    bootstrap port already taken, is refused first (before the weights load)."""
    from tokenbudget.proto.rpc.ports import check_port_free
    from tokenbudget.worker.kv_groups import layer_windows

    mode = args.disaggregation_config.mode
    if any(layer_windows(text_config)):
        raise UnsupportedArgument(
            f"--disaggregation-mode {mode} with a sliding-window model",
            "its KV cache groups (full and window layers) are not transferred yet",
        )
    if cache_config.kv_offload_memory_bytes or cache_config.num_offload_blocks:
        raise UnsupportedArgument(
            f"--disaggregation-mode {mode} with the host KV tier",
            "blocks swapped to the host are not transferred; leave --kv-offload-memory "
            "and --num-offload-blocks unset",
        )
    if mode == PREFILL:
        check_port_free(_host(placement), args.disaggregation_bootstrap_port)
    backend = args.disaggregation_config.transfer_backend
    return dataclasses.replace(cache_config, kv_transfer_backend=backend)


def _kv_connector_factory(
    args: EngineArgs, placement: Placement | None, block_size: int
) -> Callable[[KVCacheSpec], KVConnector]:
    """What EngineCore calls with its workers' KVCacheSpec: a prefill's
    connector (its bootstrap listener on --host, the worker secret if given)
    or a decode's (it registers with the prefills named by its requests)."""
    config = args.disaggregation_config
    secret = placement.secret if placement is not None else None

    def build(spec: KVCacheSpec) -> KVConnector:
        if not spec.kv_transfer_handshakes:
            raise UnsupportedArgument(
                f"--disaggregation-mode {config.mode} with these workers",
                f"they registered no KV cache with {config.transfer_backend} (no transfer "
                "handshake came back)",
            )
        if config.mode == PREFILL:
            from tokenbudget.server.engine.disagg.prefill import PrefillConnector

            host = _host(placement)
            connector = PrefillConnector(
                host,
                config.disaggregation_bootstrap_port,
                block_size,
                len(spec.kv_transfer_handshakes),
                timeout=config.disaggregation_timeout,
                secret=secret,
            )
            logger.info("KV bootstrap listener (prefill) on %s:%d", host, connector.port)
            return connector
        from tokenbudget.server.engine.disagg.decode import DecodeConnector

        return DecodeConnector(
            spec.kv_transfer_handshakes,
            block_size,
            timeout=config.disaggregation_timeout,
            secret=secret,
        )

    return build


def _host(placement: Placement | None) -> str:
    """Where a prefill's bootstrap listener binds: the server's --host (LLM: loopback)."""
    return placement.host if placement is not None else LOOPBACK


def _input_processor(args: EngineArgs, vocab_size: int, max_model_len: int) -> InputProcessor:
    return InputProcessor.from_pretrained(
        args.model,
        vocab_size=vocab_size,
        trust_remote_code=args.trust_remote_code,
        tokenizer=args.tokenizer,
        revision=args.revision,
        chat_template=args.read_chat_template(),
        max_logprobs=args.max_logprobs_for(vocab_size),
        **args.input_limits(max_model_len),
    )


def build_async_engine(
    args: EngineArgs,
    metrics: Any = None,
    placement: Placement | None = None,
    *,
    before_load: Callable[[], None] | None = None,
    is_demo: bool = False,
    record_trace: bool = False,
) -> AsyncEngine:
    """``build_engine_core``'s engine behind the thread-safe AsyncEngine
    (``metrics``: its observer; ``record_trace``: keep a TraceRecorder)."""
    parts = build_engine_core(args, placement, before_load=before_load, stoppable_compiles=True)
    trace_recorder = None
    if record_trace:
        from tokenbudget.server.engine.trace import TraceRecorder

        trace_recorder = TraceRecorder(args.block_size)
    engine = AsyncEngine(
        parts.core,
        parts.input_processor,
        metrics,
        model_name=args.model,
        served_model_name=args.served_model_name,
        sampling_defaults=parts.generation_defaults.sampling,
        eos_token_ids=parts.generation_defaults.eos_token_ids,
        is_vision_language=getattr(parts.hf_config, "vision_config", None) is not None,
        is_demo=is_demo,
        num_remote_workers=len(placement.workers) if placement else 0,
        trace_recorder=trace_recorder,
        pooler_config=parts.pooler_config,
        loras=None if args.lora_config is None else LoRARegistry(args.lora_config),
    )
    # null, prefill or decode: the gateway's handler (sglang.py) serves requests by it.
    engine.disaggregation_mode = args.disaggregation_config.mode
    return engine


def make_executor(args: EngineArgs, placement: Placement | None = None):
    """The executor ``placement`` asks for: remote workers, tensor-parallel
    ranks started here, or a Worker in this process."""
    if placement is not None and placement.workers:
        from tokenbudget.server.executor.remote import RemoteExecutor

        logger.info("driving remote workers %s", ", ".join(placement.workers))
        if args.cuda_graph_sizes not in (None, list(DEFAULT_CAPTURE_SIZES)):
            logger.warning("--cuda-graph-sizes: remote workers capture the default sizes")
        return RemoteExecutor(
            list(placement.workers),
            args.model,
            dtype=args.dtype,
            device=args.device or "",
            attention_backend=args.attention_backend,
            max_message_size=max(placement.max_message_size, 256 << 20),
            connect_timeout=placement.connect_timeout,
            step_timeout=placement.step_timeout,
            hang_timeout=placement.hang_timeout,
            secret=placement.secret,
            enforce_eager=args.enforce_eager,
            lora_config=args.lora_config,
        )
    if args.tensor_parallel_size > 1:
        from tokenbudget.server.executor.tensor_parallel import TensorParallelExecutor

        logger.info("starting %d tensor-parallel ranks", args.tensor_parallel_size)
        extra = (
            {}
            if placement is None
            else {
                "threads": placement.torch_threads,
                "step_timeout": placement.step_timeout,
                "hang_timeout": placement.hang_timeout,
            }
        )
        return TensorParallelExecutor(
            args.model,
            args.tensor_parallel_size,
            dtype=args.dtype,
            device=args.device or "",
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            lora_config=args.lora_config,
            **extra,
        )
    return _in_process_executor(args)


def _in_process_executor(args: EngineArgs):
    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker

    worker = Worker(
        args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        trust_remote_code=args.trust_remote_code,
        revision=args.revision,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        cuda_graph_sizes=args.cuda_graph_sizes,
        enforce_eager=args.enforce_eager,
        lora_config=args.lora_config,
    )
    return InProcessExecutor(worker, async_mode=args.async_scheduling)
