"""Shard a loaded decoder for tensor parallelism, following the plan its
transformers config declares (``base_model_tp_plan``).

A plan maps module-name patterns of the text decoder (``layers.*.self_attn.q_proj``)
to a style. We apply the two styles dense decoders use:

- ``colwise``: keep this rank's slice of the output features (rows of the
  weight, and of the bias). Attention projections are cut at head boundaries
  because head h owns features ``[h*head_dim, (h+1)*head_dim)``, so this rank
  sees ``num_heads / N`` query heads and ``num_key_value_heads / N`` KV heads;
  the model code derives its head count from the weight shape
  (``view(..., -1, head_dim)``), and our paged attention from the KV cache.
- ``rowwise``: keep this rank's slice of the input features (columns); the
  partial products are summed over ranks by an all-reduce, then the bias added.

Replicated styles (norms, ``embedding_rowwise``) stay whole on every rank: the
embedding and the lm_head are replicated, so every rank holds the same hidden
states after each all-reduce and computes the same logits. Styles we do not
implement (packed, MoE, sequence-parallel) are refused by name.

We apply the plan ourselves instead of ``from_pretrained(tp_plan="auto")``:
transformers' loader needs ``accelerate`` (not a dependency here) and turns the
weights into DTensors, whose per-op dispatch costs host time on every step;
plain sliced ``nn.Linear`` weights plus one all-reduce per row-parallel layer
run the same kernels as the unsharded model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

COLWISE = ("colwise",)
ROWWISE = ("rowwise", "rowwise_rep")
REPLICATED = ("replicate", "replicated_with_grad_allreduce", "embedding_rowwise")

# The plan of Llama-family decoders, for configs that declare none for their
# linear layers (Qwen3-VL's text config lists only its embedding).
DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

AllReduce = Callable[[torch.Tensor], None]


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a linear layer: its share of the output features.
    ``full_shape`` (in, out features of the whole layer) and ``shard`` (this
    rank's input and output feature slices) let a LoRA layer cut its adapters
    as the weight was cut (worker/lora_layers.py)."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int) -> None:
        super().__init__()
        rows = slice(*_share(full.out_features, rank, world_size))
        self.full_shape = (full.in_features, full.out_features)
        self.shard = (slice(0, full.in_features), rows)
        self.weight = nn.Parameter(full.weight[rows].clone(), requires_grad=False)
        self.bias = (
            None
            if full.bias is None
            else nn.Parameter(full.bias[rows].clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of a linear layer; the output is all-reduced so
    every rank holds the full result. ``before_reduce(module, (x,), out)``,
    when set, adds to the partial product in place (a LoRA layer: its
    partial delta is summed by the same all-reduce)."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        cols = slice(*_share(full.in_features, rank, world_size))
        self.full_shape = (full.in_features, full.out_features)
        self.shard = (cols, slice(0, full.out_features))
        self.before_reduce: Callable[[nn.Module, tuple, torch.Tensor], object] | None = None
        self.weight = nn.Parameter(full.weight[:, cols].clone(), requires_grad=False)
        # Added once, after the sum: on every rank it would count N times.
        self.bias = (
            None if full.bias is None else nn.Parameter(full.bias.clone(), requires_grad=False)
        )
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.before_reduce is not None:
            self.before_reduce(self, (x,), out)
        self.all_reduce(out)
        return out if self.bias is None else out + self.bias


def _share(n: int, rank: int, world_size: int) -> tuple[int, int]:
    size = n // world_size
    return rank * size, (rank + 1) * size


def check_tensor_parallel_size(text_config, world_size: int) -> None:
    """Refuse a size that does not split the heads evenly. We do not replicate
    KV heads when there are fewer than ranks (as vLLM does): refused instead."""
    from tokenbudget.worker.loader import decoder_kv_shape

    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    num_heads = int(text_config.num_attention_heads)
    _, num_kv_heads, _ = decoder_kv_shape(text_config)
    for name, value in (
        ("num_attention_heads", num_heads),
        ("num_key_value_heads", num_kv_heads),
        ("intermediate_size", getattr(text_config, "intermediate_size", None)),
    ):
        if value is not None and value % world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} does not divide the model's "
                f"{name}={value}; pick a size that divides it"
            )


def find_decoder(net: nn.Module) -> tuple[str, nn.Module]:
    """The text decoder (the module holding ``embed_tokens`` and ``layers``):
    ``model`` of a causal LM, ``model.language_model`` of a VL model. The plan
    applies to names under it only, so a vision tower stays whole."""
    for name, module in net.named_modules():
        if isinstance(getattr(module, "layers", None), nn.ModuleList) and hasattr(
            module, "embed_tokens"
        ):
            return name, module
    raise ValueError(
        f"{type(net).__name__}: found no text decoder (a module with "
        "embed_tokens and layers) to shard for tensor parallelism"
    )


def resolve_plan(text_config) -> dict[str, str]:
    plan = dict(getattr(text_config, "base_model_tp_plan", None) or {})
    if not any(style in COLWISE + ROWWISE for style in plan.values()):
        logger.info(
            "tensor parallel: %s declares no plan for its linear layers; using the "
            "Llama-family plan",
            type(text_config).__name__,
        )
        plan.update(DEFAULT_PLAN)
    return plan


def shard_model(net: nn.Module, rank: int, world_size: int, all_reduce: AllReduce) -> int:
    """Replace the decoder's planned linear layers by this rank's shards, in
    place; returns how many layers were sharded. ``all_reduce`` sums a tensor
    over the ranks in place."""
    text_config = net.config.get_text_config()
    check_tensor_parallel_size(text_config, world_size)
    prefix, decoder = find_decoder(net)
    patterns = [
        (re.compile("^" + re.escape(p).replace(r"\*", r"\d+") + "$"), style)
        for p, style in resolve_plan(text_config).items()
    ]
    replaced = []
    for name, module in decoder.named_modules():
        style = next((s for rx, s in patterns if rx.match(name)), None)
        if style is None or style in REPLICATED:
            continue
        if style not in COLWISE + ROWWISE:
            raise ValueError(
                f"tensor parallel: {prefix}.{name} has plan style {style!r}, "
                "which tokenbudget does not implement (colwise and rowwise "
                "only: dense decoders)"
            )
        if type(module) is not nn.Linear:
            raise ValueError(
                f"tensor parallel: {prefix}.{name} ({type(module).__name__}) is "
                f"planned {style!r} but is not a plain nn.Linear"
            )
        features = module.out_features if style in COLWISE else module.in_features
        if features % world_size:
            raise ValueError(
                f"tensor parallel: {prefix}.{name} has {features} features, not "
                f"divisible by tensor_parallel_size={world_size}"
            )
        shard = (
            ColumnParallelLinear(module, rank, world_size)
            if style in COLWISE
            else RowParallelLinear(module, rank, world_size, all_reduce)
        )
        replaced.append((name, shard))
    if not replaced:
        raise ValueError(
            f"tensor parallel: no layer of {type(net).__name__} matches its "
            "tensor-parallel plan; it cannot be sharded"
        )
    for name, shard in replaced:
        parent_name, _, child = name.rpartition(".")
        setattr(decoder.get_submodule(parent_name), child, shard)
    _divide_head_counts(decoder, world_size)
    return len(replaced)


def _divide_head_counts(decoder: nn.Module, world_size: int) -> None:
    """Attention modules that keep head counts as attributes (older model code
    reads them in forward) get their local counts; the ratio of query to KV
    heads (num_key_value_groups) is unchanged."""
    for module in decoder.modules():
        if not hasattr(module, "layer_idx"):
            continue
        for attr in ("num_heads", "num_attention_heads", "num_key_value_heads"):
            value = getattr(module, attr, None)
            if isinstance(value, int):
                setattr(module, attr, value // world_size)
