"""Linear layers whose weights are prepacked for oneDNN, for eager fp32 on CPU.

``F.linear`` in fp32 on CPU runs MKL's GEMM on the weight as stored; oneDNN
runs the same product on a weight reordered once into its blocked layout.
Measured on a 2-core AVX-512 machine, one thread: 226-260 against 104-110
GFLOPS at 256 -> 768 and 1024 -> 3072 for 64 to 2048 rows; and for a few rows
(decode batches), where MKL's time grows with each row while oneDNN's stays
flat, 1024 -> 3072 takes 127 against 299 us for 2 rows and 145 against 582 us
for 4. MKL wins only for a single row at small shapes (10 against 19 us at
256 -> 768; even at 1024 -> 3072). So a packed layer keeps both: the packed
copy from 2 rows on, the plain weight for one row (single-stream decode) and
for everyone else who reads ``weight`` (tied embeddings, LoRA, state dicts).
The price is a second copy of each linear weight in host memory.

Where our C++ extension is built with AVX-512, up to MAX_SMALL_ROWS rows run
its own kernel on the plain weight instead (csrc/small_rows_linear.cpp: each
weight row streamed once for all the batch's rows). A decode step then reads
one copy of the weights whatever its batch size: a serving engine whose
batches move between 1 and 4 requests no longer alternates between two copies
in the cache. One thread, tiny Qwen3's 29 linears in a row: 239 against 494 us
(oneDNN) and 403 us (MKL) at 2 rows, 212 against 247 us (MKL) at one.

The packed copy is made on the layer's first forward, from the weight the
layer has then, so sharding or moving the model before it changes nothing.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Without our small-rows kernel, fewer rows than this run F.linear on the
# plain weight (faster there).
MIN_PACKED_ROWS = 2
# Up to this many rows run our kernel on the plain weight, where it is built
# (csrc/small_rows_linear.cpp; kMaxSmallRows there).
MAX_SMALL_ROWS = 4
# Models whose linear weights take more than this keep plain layers: the
# packed copy doubles their memory.
MAX_PACKED_BYTES = 4 << 30


def prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` (set as the module's class by ``prepack_linears``)
    that multiplies 2 rows or more with a oneDNN-packed copy of its weight.
    Traced by a compiled decoder, it calls our C++ op
    ``tokenbudget_cpu::packed_linear`` (the same choice, made per call), which
    inductor keeps as it is: its own CPU GEMMs would use the plain weight."""

    _packed: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and torch.compiler.is_compiling():
            flat = x.reshape(-1, x.shape[-1])
            out = torch.ops.tokenbudget_cpu.packed_linear(
                flat, self.weight, self._packed, self.bias
            )
            return out.reshape(*x.shape[:-1], out.shape[-1])
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        op = cpp_linear()
        if op is None and rows < MIN_PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        packed = self._packed
        if packed is None:
            packed = self._packed = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach(), None
            )
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        if op is not None:  # the compiled decoder's choice, the same for every row count
            out = op(flat, self.weight, packed, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [None], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


@functools.cache
def cpp_linear():
    """Our C++ ``packed_linear`` op (None where our extension did not build)."""
    from tokenbudget.worker.attention_cpu import load_cpu_ops

    return None if load_cpu_ops() is not None else torch.ops.tokenbudget_cpu.packed_linear.default


def small_rows_kernel() -> bool:
    """Whether up to MAX_SMALL_ROWS rows run our kernel on the plain weight."""
    return cpp_linear() is not None and bool(torch.ops.tokenbudget_cpu.small_rows_linear_built())


def prepack_for_compile(model: torch.nn.Module) -> int:
    """prepack_linears for a decoder about to be compiled: the weights are
    packed now (the trace takes them as inputs) and the C++ op the trace
    calls is loaded; 0 (plain layers, inductor's GEMMs) where that op or
    oneDNN is missing."""
    from tokenbudget.worker.attention_cpu import load_cpu_ops

    if load_cpu_ops() is not None:
        return 0
    return prepack_linears(model, now=True)


def prepack_linears(model: torch.nn.Module, *, now: bool = False) -> int:
    """Make every fp32 CPU ``nn.Linear`` of ``model`` a PackedLinear; returns
    how many. Nothing changes where oneDNN is missing. ``now``: pack the
    weights at once, not on first use."""
    if not prepack_available():
        logger.info("linear layers: plain F.linear (this torch has no oneDNN)")
        return 0
    linears = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
    ]
    size = sum(m.weight.numel() * 4 for m in linears)
    if size > MAX_PACKED_BYTES:
        logger.info(
            "linear layers: plain F.linear (%.1f GiB of fp32 weights; a packed copy "
            "would double that)",
            size / (1 << 30),
        )
        return 0
    for module in linears:
        module.__class__ = PackedLinear
        packed = None
        if now:
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        # A buffer (not saved), so a compiled decoder takes it as an input like the weight.
        module.register_buffer("_packed", packed, persistent=False)
    logger.info(
        "linear layers: %d with oneDNN-packed weights (fp32, CPU)%s",
        len(linears),
        f"; up to {MAX_SMALL_ROWS} rows our kernel on the plain weight"
        if small_rows_kernel()
        else "",
    )
    return len(linears)
