"""The compiled decoder: ``torch.compile`` of the model forward, one trace for
every step.

Inductor fuses what eager runs op by op (RMSNorm, rotary, SiLU * mul, the
residual adds and the module glue around them); the linears stay extern
GEMMs (see FREEZE_ON_CPU for why not prepacked). Two things keep it to one trace:

* **Attention is opaque.** The decoder's attention calls the custom op
  ``tokenbudget::paged_attention(q, k, v, layer_idx, scale, window, softcap)``; dynamo
  sees only its fake (shape) implementation. The real one reads the step's
  ``PagedAttentionMetadata`` from a per-thread forward context the runner sets
  around the call (``forward_context``), never from graph inputs, so the
  per-step ints in the metadata (lengths, group plans) never become guards.
  Any attention backend works: the op runs ``paged_attention_forward``.
  With KV cache groups (worker/kv_groups.py) the metadata names each
  layer's group (``by_layer``), read there too: one trace serves every group.
* **The token count is symbolic.** The packed sequence's length and the
  number of kept logits rows are marked dynamic on every call, and sizes are
  treated obliviously (``backed_size_oblivious``), so a 1-token decode step
  reuses the trace of a 3000-token prefill instead of specialising on 1.
  So after the warm-up and the first step the decoder skips dynamo's guards
  (``skip_guard_eval_unsafe``): they would only re-check every parameter.

The op declares no mutated argument although it writes the layer's KV cache:
the cache is not a graph value (no traced op reads or writes it), and every
layer's op consumes the previous layer's output, so inductor can neither drop
nor reorder the writes.

Compiled code is cached on disk by inductor (its FX graph cache, under
``$TORCHINDUCTOR_CACHE_DIR``; default ``/tmp/torchinductor_$USER``), so a
restart with the same model and torch recompiles in a fraction of the cold time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from tokenbudget.worker.attention import (
    PAGED_ATTENTION,
    PagedAttentionMetadata,
    build_metadata,
    paged_attention_forward,
)
from tokenbudget.worker.attention_cpu import attend_step
from tokenbudget.worker.packed_linear import prepack_for_compile, prepack_linears

logger = logging.getLogger(__name__)

# The transformers attn_implementation of a compiled decoder: the custom op.
PAGED_ATTENTION_OP = "tokenbudget_paged_op"
# Inductor freezing on CPU: off. It folds the weights into the graph so that
# inductor prepacks the linears for oneDNN, but measured here (2-core AVX-512,
# tiny Qwen3 fp32) it ran workload (a) 0.3-0.5x as fast as eager, the FX graph
# cache does not keep frozen graphs (every start compiles cold), and each
# engine in a process recompiles. benchmarks/offline_throughput.py --freeze.
FREEZE_ON_CPU = False

_context = threading.local()
# Calls that evaluate dynamo's guards (and may compile): the warm-up and the
# first real step; later calls skip them (CompiledDecoder.__call__).
_GUARDED_CALLS = 2


@dataclass(frozen=True, slots=True)
class _Layer:
    """What ``paged_attention_forward`` reads of the attention module."""

    layer_idx: int


@contextlib.contextmanager
def forward_context(meta: PagedAttentionMetadata) -> Iterator[None]:
    """The metadata every ``tokenbudget::paged_attention`` call of this
    thread's forward reads."""
    previous = getattr(_context, "meta", None)
    _context.meta = meta
    try:
        yield
    finally:
        _context.meta = previous


def _paged_attention_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> out [1, T, H, D]; writes
    K/V into layer ``layer_idx``'s cache and attends (see the module doc).
    ``sliding_window`` and ``softcap`` (Gemma-2's attention logit cap): 0 is off."""
    meta = getattr(_context, "meta", None)
    if meta is None:
        raise RuntimeError("tokenbudget::paged_attention runs only inside forward_context(meta)")
    layer_meta = meta if meta.by_layer is None else meta.by_layer[layer_idx]
    if layer_meta.backend == "cpu" and (not sliding_window or sliding_window == layer_meta.window):
        return attend_step(query, key, value, layer_meta, layer_idx, scale, softcap)
    out, _ = paged_attention_forward(
        _Layer(layer_idx),
        query,
        key,
        value,
        None,
        scale,
        paged_attn=meta,
        sliding_window=sliding_window or None,
        softcap=softcap or None,
    )
    return out.contiguous()  # the strides the fake promised


def _paged_attention_shape(query, key, value, layer_idx, scale, sliding_window, softcap=0.0):
    _, num_heads, num_tokens, head_dim = query.shape
    return query.new_empty(1, num_tokens, num_heads, value.shape[-1])


# Defined through torch.library's low-level API, not ``custom_op``: a compiled
# step calls the op once per layer, and custom_op's Python wrapper (argument
# binding, an output-aliasing check per call) cost about a tenth of a batch-1
# decode step on CPU. One kernel for every device (CompositeExplicitAutograd);
# steps run under inference_mode, so no autograd formula is needed.
_LIB = torch.library.Library("tokenbudget", "DEF")
_LIB.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer_idx, float scale, "
    "int sliding_window, float softcap=0.0) -> Tensor"
)
_LIB.impl("paged_attention", _paged_attention_impl, "CompositeExplicitAutograd")
torch.library.register_fake("tokenbudget::paged_attention", _paged_attention_shape, lib=_LIB)
paged_attention_op = torch.ops.tokenbudget.paged_attention.default


def op_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The AttentionInterface entry point of a compiled decoder; a forward
    given ``paged_attn`` (the runner's eager steps: pooling) runs eagerly."""
    if kwargs.get("paged_attn") is not None:
        return paged_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks are not supported by the paged backend")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    return paged_attention_op(query, key, value, module.layer_idx, scale, window, softcap), None


def _register_op_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION_OP, op_attention_forward)


def eager_by_default(device: torch.device) -> bool:
    """``enforce_eager=None``: eager on CPU, where a compile costs 10-50 s of
    start-up on 2 busy cores (about a fifth of that from the on-disk cache)
    and the test suite starts hundreds of engines; compiled elsewhere."""
    return device.type == "cpu"


def eager_reason(runner) -> str | None:
    """Why ``runner``'s model stays eager, or None when it is compiled."""
    if runner.enforce_eager:
        return "enforce_eager"
    if runner.vision is not None:
        return "vision-language models run eagerly"
    if runner.parallel is not None:
        return "tensor-parallel ranks run eagerly"
    if any(
        getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)
        for m in runner.model.modules()
    ):
        # Its query scale depends on each token's position, which the op
        # (it sees only the layer index) cannot rescale: attention.py does.
        return "attention temperature tuning (Llama 4's NoPE layers) runs eagerly"
    return None


def compile_decoder(runner) -> CompiledDecoder | None:
    """The compiled decoder of a ModelRunner whose KV cache is allocated,
    compiled now by a warm-up step (None when it stays eager)."""
    reason = eager_reason(runner)
    if reason is not None:
        logger.info("decoder: eager (%s)", reason)
        _prepack_eager(runner)
        return None
    if runner.device.type == "cpu" and runner.parallel is None:
        prepack_for_compile(runner.model)  # GEMMs on oneDNN-packed weights
    decoder = CompiledDecoder(runner.model)
    try:
        decoder.warm_up(runner.attention_backend, runner.kv_caches, runner.block_size)
    except Exception as exc:  # no C++ compiler, an op inductor cannot lower ...
        _switch_attention(runner.model, PAGED_ATTENTION_OP, PAGED_ATTENTION)
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        logger.warning("decoder: eager, compiling failed: %s", why)
        _prepack_eager(runner)
        return None
    logger.info(
        "decoder: compiled in %.1f s (inductor cache %s; --enforce-eager skips it)",
        decoder.compile_seconds,
        cache_dir(),
    )
    return decoder


def _prepack_eager(runner) -> None:
    """An eager decoder on CPU multiplies with oneDNN-packed fp32 weights
    (worker/packed_linear.py); tensor-parallel ranks keep plain layers."""
    if runner.device.type == "cpu" and runner.parallel is None:
        prepack_linears(runner.model)


def cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


class CompiledDecoder:
    """``model`` (a causal LM whose decoder uses PAGED_ATTENTION) behind one
    compiled trace: ``decoder(input_ids [T], positions [T], keep [K], meta)``
    returns the logits rows ``keep`` [K, vocab]."""

    def __init__(self, model: torch.nn.Module, *, freeze: bool | None = None) -> None:
        _register_op_attention()
        _switch_attention(model, PAGED_ATTENTION, PAGED_ATTENTION_OP)
        self.model = model
        self.device = next(model.parameters()).device
        self.compile_seconds = 0.0  # of the first call: tracing and compiling
        self.num_calls = 0
        self.num_compiles = 0  # graphs inductor compiled for this decoder: 1, or a recompile
        self.guarded_calls = _GUARDED_CALLS  # calls that evaluate dynamo's guards
        # Freezing folds the weights into the graph as constants (FREEZE_ON_CPU).
        if freeze is None:
            freeze = FREEZE_ON_CPU and self.device.type == "cpu"
        self.freeze = freeze
        # One backend for all decoders: engines of one architecture in one
        # process share the trace (unfrozen weights are graph inputs).
        self._fn: Callable = torch.compile(
            self._forward, backend=_inductor, fullgraph=True, dynamic=False
        )

    def warm_up(self, backend: str, kv_caches: list[torch.Tensor], block_size: int) -> None:
        """Compile with one 2-token step whose K/V land in the null block 0
        (never read unmasked), so the first real step finds the trace ready."""
        num_tokens = 2
        meta = build_metadata(
            backend,
            kv_caches,
            block_size,
            np.array([num_tokens]),
            np.array([num_tokens]),
            np.zeros((1, -(-num_tokens // block_size)), np.int32),
            np.zeros(num_tokens, np.int64),
            self.device,
        )
        # Made as the runner makes them, under inference_mode: dynamo guards
        # on the dispatch keys, which inference tensors lack some of.
        with torch.inference_mode():
            ids, positions, keep = (
                torch.from_numpy(a).to(self.device)
                for a in (np.zeros(num_tokens, np.int64), np.arange(num_tokens), np.array([1]))
            )
            self(ids, positions, keep, meta)

    def _forward(self, input_ids, positions, keep):
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
        )
        return out.logits[0]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        if keep.numel() == 0:  # no row sampled: from numpy it has stride 0, a guard
            keep = keep.new_empty(0)
        if self.num_calls >= self.guarded_calls:
            # Warmed up: one trace serves every step (the token count is symbolic;
            # tests/worker/test_compiled_decoder.py checks with guards on that no
            # step recompiles), so dynamo's guards over every parameter only cost
            # time: a fifth of a batch-1 CPU decode step.
            with forward_context(meta), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                self.num_calls += 1
                return self._fn(input_ids, positions, keep)
        for t in (input_ids, positions, keep):
            torch._dynamo.mark_dynamic(t, 0)
        _context.decoder = self  # whom _inductor counts a compile for
        with forward_context(meta), _compile_config(self.freeze):
            first = self.num_calls == 0
            t0 = time.perf_counter()
            logits = self._fn(input_ids, positions, keep)
            if first:
                self.compile_seconds = time.perf_counter() - t0
            self.num_calls += 1
        return logits


def _inductor(gm: torch.fx.GraphModule, example_inputs):
    """Inductor, counting the graphs compiled for the calling decoder."""
    from torch._inductor.compile_fx import compile_fx

    _context.decoder.num_compiles += 1
    return compile_fx(gm, example_inputs)


@contextlib.contextmanager
def _compile_config(freeze: bool) -> Iterator[None]:
    """What a (re)compile in this call sees; torch.compile's own ``options``
    do not reach the freezing switch, which inductor reads before them."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True), inductor_config.patch(freezing=freeze):
        yield


def _switch_attention(model: torch.nn.Module, old: str, new: str) -> None:
    """Point every config of ``model`` using ``old`` at ``new`` (the decoder
    layers share one text config object)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for config in configs.values():
        if getattr(config, "_attn_implementation", None) == old:
            config._attn_implementation = new
