"""Batched LoRA on the stock transformers model: every targeted linear adds
``scale_i * (x A_i^T) B_i^T`` for each token's adapter slot i.

Each targeted ``nn.Linear`` (the attention and MLP projections) gets a
forward hook and stacked per-slot weights ``A [slots, max_rank, in]`` and
``B^T [slots, max_rank, out]`` (slot 0 is the base model: zeros, never
computed; an adapter of lower rank is zero-padded, the scale is folded into
B when a slot is filled). ``LoRAStep`` holds the forward's token-to-slot
map in one of two forms, chosen per step:

- dense (small steps, decodes): every token times every slot's A in one
  matmul, a per-token mask keeps its own slot's rank columns, one addmm
  with every slot's B. Three kernels per layer whatever the adapters; the
  extra FLOPs (max_loras x max_rank columns) are cheap next to the launch
  and Python cost of a small step.
- grouped (large steps, prefill chunks): the adapted tokens sorted by
  slot; one gather, two matmuls per adapter in the step (at most
  max_loras), one index_add. Base tokens cost nothing.

A step without adapters only pays each hook's check.

Under tensor parallelism an adapter is cut as its base weight was
(worker/parallel/sharding.py): a column-parallel layer keeps its rows of B
(its output features) and all of A; a row-parallel layer keeps its columns
of A (its input features) and all of B, and its partial delta is added
before the layer's all-reduce, which sums it with the base products. So
LoRA adds no communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenbudget.core.lora import TARGET_MODULES

# The dense form while its per-layer intermediate (tokens x m x max_rank)
# stays this small, and its width (m x max_rank) at most this many times the
# narrowest layer (beyond, the columns of other slots cost more FLOPs than the
# grouped form's per-adapter kernels; measured with benchmarks/lora.py).
DENSE_MAX_ELEMENTS = 1 << 20
DENSE_MAX_WIDTH_FACTOR = 4


@dataclass(slots=True)
class LoRAStep:
    """The forward's token-to-slot map, shared by every LoRA layer: ``mask``
    (dense form) or ``order`` and ``segments`` (grouped form); neither: no
    token of this forward uses an adapter."""

    mask: torch.Tensor | None = None
    width: int = 0  # the dense form's columns: slots 1..m used, m x max_rank
    order: torch.Tensor | None = None
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)

    def set(
        self,
        token_slots: np.ndarray,
        ranks: dict[int, int],
        shape: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """Map the packed tokens to slots (``token_slots``: one per token, 0 =
        base); ``shape``: (max_rank, narrowest layer width) of the layers."""
        self.clear()
        adapted = np.flatnonzero(token_slots)
        if not len(adapted):
            return
        # Slots fill from 1 up: the dense form spans only slots 1..m.
        m, (max_rank, narrowest) = int(token_slots.max()), shape
        width = m * max_rank
        if (
            len(token_slots) * width <= DENSE_MAX_ELEMENTS
            and width <= DENSE_MAX_WIDTH_FACTOR * narrowest
        ):
            mask = np.zeros((len(token_slots), m, max_rank), np.float32)
            mask[adapted, token_slots[adapted] - 1] = 1.0
            self.width = width
            mask = torch.from_numpy(mask.reshape(len(token_slots), -1))
            self.mask = mask.to(device=device, dtype=dtype, non_blocking=True)
            return
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        slots, counts = np.unique(token_slots[order], return_counts=True)
        ends = np.cumsum(counts)
        self.segments = [
            (int(s), int(e - c), int(e), ranks[int(s)]) for s, c, e in zip(slots, counts, ends)
        ]
        self.order = torch.from_numpy(order).to(device, non_blocking=True)

    def clear(self) -> None:
        self.mask = None
        self.order = None
        self.segments = []


class LoRALayer:
    """The stacked adapter weights of one linear, applied by its forward hook."""

    __slots__ = ("name", "shape", "shard", "lora_a", "lora_bt", "a_all", "bt_all", "step")

    def __init__(
        self, name: str, base: torch.nn.Module, num_slots: int, max_rank: int, step: LoRAStep
    ) -> None:
        w = base.weight
        out_f, in_f = w.shape  # this rank's share when sharded
        self.name = name
        # (in_features, out_features) of the whole base linear, as adapters see it.
        self.shape: tuple[int, int] = getattr(base, "full_shape", (in_f, out_f))
        # This rank's slices of the input and output features (all of them unsharded).
        self.shard: tuple[slice, slice] = getattr(base, "shard", (slice(None), slice(None)))
        self.lora_a = w.new_zeros(num_slots, max_rank, in_f)
        self.lora_bt = w.new_zeros(num_slots, max_rank, out_f)
        # Every adapter slot's A rows and B^T rows, as views (the dense form).
        self.a_all = self.lora_a[1:].view(-1, in_f)
        self.bt_all = self.lora_bt[1:].view(-1, out_f)
        self.step = step

    def fill(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot ``slot`` := A [r, in], B [out, r] (scale folded in); None: this
        adapter leaves the layer alone."""
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        if a is not None:
            r, (ins, outs) = a.shape[0], self.shard
            self.lora_a[slot, :r].copy_(a[:, ins])
            self.lora_bt[slot, :r].copy_(b[outs].T)

    def __call__(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor):
        step = self.step
        if step.mask is None and step.order is None:
            return output
        x = inputs[0]
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = output.view(-1, output.shape[-1])
        if step.mask is not None:
            width = step.width
            h = (flat_x @ self.a_all[:width].T).mul_(step.mask)
            flat_y.addmm_(h, self.bt_all[:width])
            return output
        xs = flat_x.index_select(0, step.order)
        deltas = [
            (xs[start:end] @ self.lora_a[slot, :rank].T) @ self.lora_bt[slot, :rank]
            for slot, start, end, rank in step.segments
        ]
        flat_y.index_add_(0, step.order, deltas[0] if len(deltas) == 1 else torch.cat(deltas))
        return output


def attach_lora_layers(
    model: torch.nn.Module, num_slots: int, max_rank: int, step: LoRAStep
) -> dict[str, LoRALayer]:
    """Hook a LoRALayer on every decoder linear named like a TARGET_MODULES
    projection (the vision tower's are left alone); by module name."""
    layers: dict[str, LoRALayer] = {}
    for name, module in model.named_modules():
        # The sharded linears of worker/parallel/sharding.py carry ``shard``
        # (known by it: worker.parallel depends on this module, not the reverse).
        linear = isinstance(module, torch.nn.Linear) or hasattr(module, "shard")
        if not linear or name.rsplit(".", 1)[-1] not in TARGET_MODULES:
            continue
        if "visual" in name or "vision" in name:
            continue
        layer = LoRALayer(name, module, num_slots, max_rank, step)
        if hasattr(module, "before_reduce"):  # row-parallel
            module.before_reduce = layer  # its partial delta joins the all-reduce
        else:
            module.register_forward_hook(layer)
        layers[name] = layer
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no linear layer named {', '.join(TARGET_MODULES)}; "
            "LoRA cannot be served on this model"
        )
    return layers
