"""KV cache groups, worker side (the scheduler side is core/kv/groups.py).

Layers are grouped by attention window (0: full, W > 0: sliding, -C: chunked
local attention in chunks of C tokens, core/kv/groups.py). Block ids reach the batch
interleaved over the G groups (block j of group g at column j * G + g), so
group g's table is ``block_table[:, g::G]`` and its slots come from it.

Memory: layer i of each group (its i-th layer) shares one KV tensor. A block
id belongs to one group at a time (one shared pool), so the tensors of
``max(layers per group)`` layers hold every group: a block costs the bytes of
that many layers, not of every layer. Groups of unequal size leave the
smaller groups' share of the extra tensors unused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tokenbudget.core.kv.groups import chunked, group_layers
from tokenbudget.worker.attention import (
    allocate_kv_caches,
    build_metadata,
    kv_cache_bytes_per_block,
)
from tokenbudget.worker.kv_cache import blocks_per_request

logger = logging.getLogger(__name__)

# Backends that compute a window, a chunk and a soft-cap exactly.
_WINDOW_BACKENDS = ("sdpa", "triton", "cpu")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Which KV group and which KV tensor each decoder layer uses."""

    windows: tuple[int, ...]  # attention window of each group (0: full, -C: chunked)
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]  # index of the layer's KV tensor
    num_slots: int
    softcap: float | None  # attention soft-cap (Gemma-2), None when off

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def plain(self) -> bool:
        """Every layer attends to the full context without a soft-cap."""
        return self.windows == (0,) and not self.softcap


def layer_windows(text_config) -> list[int]:
    """The attention window of each decoder layer (0: full attention, -C:
    chunked local attention), read the way transformers builds its masks:
    ``layer_types`` when the config has them (``chunked_attention`` layers
    attend within ``attention_chunk_size`` tokens, Llama 4), else every layer
    uses ``sliding_window`` (Mistral)."""
    n = int(text_config.num_hidden_layers)
    window = getattr(text_config, "sliding_window", None) or 0
    if getattr(text_config, "use_sliding_window", True) is False:
        window = 0
    types = getattr(text_config, "layer_types", None)
    chunk = getattr(text_config, "attention_chunk_size", None) if types else None
    if types is None or not (window or chunk):
        return [int(window)] * n
    kinds = {"full_attention": 0, "sliding_attention": int(window)}
    if chunk:
        kinds["chunked_attention"] = chunked(int(chunk))
    out = []
    for t in types:
        if t not in kinds:
            raise ValueError(
                f"layer type {t!r} is not supported (full, sliding and chunked attention"
                " with an attention_chunk_size)"
            )
        out.append(kinds[t])
    return out


def kv_layout(text_config) -> KVLayout:
    windows, layer_group = group_layers(layer_windows(text_config))
    seen = [0] * len(windows)
    slots = []
    for g in layer_group:
        slots.append(seen[g])
        seen[g] += 1
    softcap = getattr(text_config, "attn_logit_softcapping", None) or None
    return KVLayout(windows, tuple(layer_group), tuple(slots), max(seen), softcap)


def backend_for(backend: str, layout: KVLayout) -> str:
    """``backend``, or sdpa when it cannot compute the layout's windows,
    chunks or soft-cap."""
    if layout.plain or backend in _WINDOW_BACKENDS:
        return backend
    logger.info(
        "attention: %s computes no sliding window / chunked attention / soft-cap;"
        " this model runs on sdpa",
        backend,
    )
    return "sdpa"


def layout_block_bytes(runner, block_size: int) -> int:
    """Bytes of one block: K and V of the layers of the largest group."""
    _, num_kv_heads, head_dim = runner._kv_shape
    return kv_cache_bytes_per_block(
        runner.kv_layout.num_slots, block_size, num_kv_heads, head_dim, runner.dtype
    )


def blocks_per_seq(runner, scheduler_config, block_size: int) -> int:
    """Blocks one sequence at full length holds over every group: a sliding
    group at most its window plus one prefill chunk (and a partial block); a
    chunked group (window -C) as much, since a chunk starts at most C - 1
    tokens before the next computed position."""
    full = blocks_per_request(scheduler_config, block_size)
    chunk = scheduler_config.max_num_batched_tokens + scheduler_config.num_speculative_tokens
    return sum(
        full if w == 0 else min(full, -(-(abs(w) - 1 + chunk) // block_size) + 1)
        for w in runner.kv_layout.windows
    )


def layout_kv_caches(runner, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """One KV tensor per decoder layer of ``runner``'s model, shared across groups."""
    _, num_kv_heads, head_dim = runner._kv_shape
    layout = runner.kv_layout
    tensors = allocate_kv_caches(
        layout.num_slots, num_blocks, block_size, num_kv_heads, head_dim, runner.dtype,
        runner.device,
    )  # fmt: skip
    return [tensors[s] for s in layout.layer_slot]


def group_metadata(runner, step, seq_lens: np.ndarray, rows_rep: np.ndarray):
    """A step's attention metadata for every group; the first group's,
    with ``by_layer`` naming each layer's, is what the model gets."""
    layout, table, bs = runner.kv_layout, runner.batch.block_table, runner.block_size
    query_lens, rows, positions = step.query_lens, step.rows, step.positions
    num_groups = layout.num_groups
    max_blocks = -(-int(seq_lens.max()) // bs)
    metas = []
    for g, window in enumerate(layout.windows):
        slots = table[rows_rep, (positions // bs) * num_groups + g].astype(np.int64) * bs
        metas.append(
            build_metadata(
                runner.attention_backend,
                runner.kv_caches,
                bs,
                query_lens,
                seq_lens,
                table[rows][:, g::num_groups][:, :max_blocks],
                slots + positions % bs,
                runner.device,
                window=max(window, 0),
                chunk=max(-window, 0),
            )
        )
    metas[0].by_layer = [metas[g] for g in layout.layer_group]
    return metas[0]
