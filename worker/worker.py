"""Worker: one model replica with its KV cache, driven step by step."""

from __future__ import annotations

import torch

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.outputs import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenbudget.core.lora import LoRAConfig
from tokenbudget.worker.kv_cache import ParallelGroup
from tokenbudget.worker.kv_transfer_mooncake import MooncakeKVTransfer
from tokenbudget.worker.kv_transfer_nixl import NixlKVTransfer
from tokenbudget.worker.lora import enable_lora
from tokenbudget.worker.model_runner import ModelRunner


# Both import their library only when constructed: neither is needed otherwise.
_KV_TRANSFERS = {"nixl": NixlKVTransfer, "mooncake": MooncakeKVTransfer}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Worker:
    """Loads the model at construction; ``initialize`` allocates the KV cache."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        attention_backend: str = "auto",
        trust_remote_code: bool = False,
        revision: str | None = None,
        kv_cache_dtype: str = "auto",
        seed: int | None = None,
        parallel: ParallelGroup | None = None,
        cuda_graph_sizes: list[int] | None = None,
        enforce_eager: bool | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """``seed`` seeds torch's global generator, which requests without a
        seed of their own draw from (vLLM's ``seed`` engine argument).
        ``parallel``: this rank's tensor-parallel group (worker/parallel).
        ``lora_config``: serve LoRA adapters (worker/lora.py); None: off."""
        if seed is not None:
            torch.manual_seed(seed)
        self.model_name = model
        self.model_runner = ModelRunner(
            model,
            dtype=dtype,
            device=device or default_device(),
            attention_backend=attention_backend,
            trust_remote_code=trust_remote_code,
            revision=revision,
            kv_cache_dtype=kv_cache_dtype,
            parallel=parallel,
            cuda_graph_sizes=cuda_graph_sizes,
            enforce_eager=enforce_eager,
        )
        if lora_config is not None:  # before initialize: LoRA runs eager
            enable_lora(self.model_runner, lora_config)
        # Disaggregated prefill/decode: the KV transfer backend's worker side.
        self.kv_transfer: NixlKVTransfer | MooncakeKVTransfer | None = None

    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        """Allocate the KV cache; returns its size (device blocks, block 0
        included, and host tier slots) and, with a ``kv_transfer_backend``,
        this rank's handshake for peers. ``cache_config`` is not written to."""
        self._close_kv_transfer()  # initialized again: the old cache goes
        num_blocks = self.model_runner.initialize_kv_cache(cache_config, scheduler_config)
        runner = self.model_runner
        windows = runner.kv_layout.windows
        handshakes = self._start_kv_transfer(cache_config.kv_transfer_backend)
        return KVCacheSpec(
            num_blocks,
            runner.num_offload_blocks,
            () if windows == (0,) else windows,
            kv_transfer_handshakes=handshakes,
        )

    def _start_kv_transfer(self, backend: str) -> tuple[bytes, ...]:
        """Register the KV cache with ``backend`` ("": none); this rank's handshake."""
        if not backend:
            return ()
        runner = self.model_runner
        transfer_class = _KV_TRANSFERS.get(backend)
        if transfer_class is None:
            choices = " or ".join(_KV_TRANSFERS)
            raise ValueError(f"kv_transfer_backend={backend!r} is not supported; use {choices}")
        if runner.kv_layout.windows != (0,):
            raise ValueError(
                "disaggregated prefill/decode does not support models with sliding-window layers"
            )
        if runner.host_kv is not None:
            raise ValueError("disaggregated prefill/decode does not support the host KV tier")
        rank = getattr(runner.parallel, "rank", 0)  # TP: this rank's share of the KV heads
        self.kv_transfer = transfer_class(runner.kv_caches, rank, runner.block_size)
        return (self.kv_transfer.handshake(),)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        transfer, meta = self.kv_transfer, scheduler_output.kv_connector_metadata
        if transfer is None:
            return self.model_runner.execute_model(scheduler_output)
        if meta is not None:
            transfer.start(meta)  # before this step's forward
        out = self.model_runner.execute_model(scheduler_output)
        out.finished_sending, out.failed_sending = transfer.poll()
        return out

    def _close_kv_transfer(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            self.kv_transfer = None

    def shutdown(self) -> None:
        # Drop the cache and weights now rather than at garbage collection, so a
        # following engine in the same process gets the memory back.
        self._close_kv_transfer()
        runner = self.model_runner
        runner.kv_caches = []
        runner.host_kv = None
        runner.cuda_graphs = None  # its graphs hold the cache's addresses
        runner.requests.clear()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
