"""Which decode batch sizes get a CUDA graph (worker/cuda_graphs.py): the
settings behind ``--cuda-graph-sizes`` / ``--cuda-graph-max-bs`` and the
bucket a step falls in. No torch here: the server's argument checks use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenbudget.core.config import setting

MODEL = "model"  # the `server --help` group (args.MODEL)
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(slots=True, frozen=True)
class CudaGraphConfig:
    """The CUDA-graph settings (EngineArgs takes these fields over)."""

    cuda_graph_sizes: list[int] | str | None = setting(
        None,
        "decode batch sizes captured as CUDA graphs, e.g. --cuda-graph-sizes 1 2 4 8 (default "
        f"{' '.join(map(str, DEFAULT_CAPTURE_SIZES))}). A decode-only step (every request "
        "computes one token) runs as the graph of the smallest size holding its batch, padded; "
        "prompt chunks, spec-decode verify steps and larger batches run eagerly. Needs a "
        "CUDA device and a backend reading the paged cache in place (triton: auto's choice "
        "on CUDA without flash-attn); --enforce-eager turns graphs off",
        group=MODEL,
        nargs="+",
        metavar="N",
    )
    cuda_graph_max_bs: int | None = setting(
        None,
        "SGLang's spelling: capture the default sizes below N, and N (instead of "
        "--cuda-graph-sizes)",
        group=MODEL,
        metavar="N",
    )


def capture_sizes(
    sizes: Sequence[int | str] | str | None = None, max_bs: int | None = None
) -> tuple[int, ...]:
    """The buckets to capture, ascending: ``sizes`` (``--cuda-graph-sizes``:
    numbers, or text such as "1,2,4" or "1 2 4"), else the defaults below
    ``max_bs`` (SGLang's ``--cuda-graph-max-bs``) and ``max_bs`` itself, else
    DEFAULT_CAPTURE_SIZES."""
    if sizes is not None and max_bs is not None:
        raise ValueError("give cuda_graph_sizes or cuda_graph_max_bs, not both")
    if max_bs is not None:
        if max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
        return tuple(s for s in DEFAULT_CAPTURE_SIZES if s < max_bs) + (max_bs,)
    if sizes is None:
        return DEFAULT_CAPTURE_SIZES
    items = [sizes] if isinstance(sizes, (str, int)) else list(sizes)
    words = [w for item in items for w in str(item).replace(",", " ").split()]
    try:
        parsed = sorted({int(w) for w in words})
    except ValueError:
        parsed = []
    if not parsed or parsed[0] < 1:
        raise ValueError(
            f"cuda_graph_sizes must be batch sizes >= 1 such as '1 2 4', got {sizes!r}"
        )
    return tuple(parsed)


def bucket_for(sizes: Sequence[int], query_lens: np.ndarray) -> int | None:
    """The smallest bucket holding this step's batch, or None when the step
    is not decode-only (a prompt chunk or a spec-decode verify has a query
    longer than one token) or its batch exceeds the largest bucket."""
    n = len(query_lens)
    if n == 0 or n > sizes[-1] or not (query_lens == 1).all():
        return None
    return sizes[int(np.searchsorted(sizes, n))]
