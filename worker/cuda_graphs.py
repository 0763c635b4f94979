"""CUDA graphs for decode steps: capture once per batch-size bucket, replay
when a step is decode-only and its batch fits a bucket.

A decode step of a small model is mostly kernel launches: hundreds per layer
stack, each a few microseconds of CPU for a few microseconds of GPU work. A
graph replays the whole forward with one launch. Graphs need fixed shapes and
fixed addresses, so each bucket of ``B`` requests owns

* **static inputs**: views of one set of device buffers sized for the largest
  bucket (input ids, positions, slot mapping, block tables, seq lens,
  query/seq start locations). A step copies its inputs into them with
  ``copy_`` and replays; nothing inside the graph reads host memory;
* **static attention metadata**: a ``PagedAttentionMetadata`` whose tensors
  are those views, ``max_query_len == 1`` and ``max_seq_len`` the block
  table's whole span (an upper bound for every step), so only backends that
  read the paged cache in place from these tensors can be captured; SDPA
  plans its groups on the host per step and stays eager;
* **padding rows** for a batch smaller than its bucket: token 0 at position
  0, one-token contexts whose only block is the null block 0, writing their
  K/V to slot 0 of that block. The scheduler never hands block 0 to a
  request, so padding never reads or writes a real request's KV.

Capture happens once, in ``ModelRunner.initialize_kv_cache`` after the KV
cache (and the compiled decoder, if any) exists, from the largest bucket
down, sharing one memory pool. Graphs are off with ``enforce_eager``, on CPU,
for vision-language models, tensor-parallel ranks and backends that plan on
the host; a capture that fails leaves the runner eager with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenbudget.worker.attention import _PAGED_KERNEL_MODULES, PagedAttentionMetadata
from tokenbudget.worker.cuda_graph_sizes import bucket_for, capture_sizes
from tokenbudget.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

# Static buffer regions start at multiples of this many elements (kernels
# specialise on 16-byte aligned pointers).
_ALIGN = 32
# Eager runs before each capture: lazy initialisation (cuBLAS handles,
# autotuning, allocator growth) must not happen inside the graph.
_WARMUP_RUNS = 2

# fn -> a replay callable returning fn's outputs; tests pass ``lambda fn: fn``.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def graphs_off_reason(runner) -> str | None:
    """Why ``runner`` (a ModelRunner) captures no graphs, or None."""
    if getattr(runner, "enforce_eager", False):
        return "enforce_eager"
    if runner.device.type != "cuda":
        return f"device {runner.device.type}"
    if runner.vision is not None:
        return "vision-language models run eagerly"
    if runner.parallel is not None:
        return "tensor-parallel ranks run eagerly"
    if not getattr(getattr(runner, "kv_layout", None), "plain", True):
        return "sliding-window / soft-capped attention (KV cache groups) runs eagerly"
    if runner.attention_backend not in _PAGED_KERNEL_MODULES:
        return (
            f"the {runner.attention_backend} attention backend plans each step on the host; "
            "--attention-backend triton reads the paged cache in place and can be captured"
        )
    return None


class DecodeGraphs:
    """Static buffers, per-bucket metadata and the captured replays.

    ``forward(input_ids, positions, keep, meta) -> logits [len(keep), vocab]``
    is the runner's model call; it runs on the static buffers only."""

    def __init__(
        self,
        sizes: Sequence[int],
        max_num_seqs: int,
        block_table_width: int,
        block_size: int,
        backend: str,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        # A bucket above max_num_seqs is useful only as the one holding it.
        sizes = sorted(sizes)
        cut = int(np.searchsorted(sizes, max_num_seqs))
        self.sizes = tuple(sizes[: cut + 1])
        n, w = self.sizes[-1], block_table_width
        self.device = device
        self.block_size = block_size
        self.max_seq_len = w * block_size

        # Two device buffers, each written by one host->device copy per step:
        # int64 [3, n] (input ids, positions, slots) and int32 regions (seq
        # lens, query and seq start locations, then the block tables last, so
        # a bucket of b rows copies only the prefix it uses), each region
        # starting 128-byte aligned.
        a = _ALIGN
        self._offsets = (0, _up(n, a), _up(n, a) + _up(n + 1, a), _up(n, a) + 2 * _up(n + 1, a))
        self._host64 = np.zeros((3, n), np.int64)
        self._host32 = np.zeros(self._offsets[3] + n * w, np.int32)
        self._dev64 = torch.zeros(self._host64.shape, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(self._host32.shape, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64
        o = self._offsets
        self.seq_lens = self._dev32[o[0] : o[0] + n]
        self.query_start_loc = self._dev32[o[1] : o[1] + n + 1]
        self.seq_start_loc = self._dev32[o[2] : o[2] + n + 1]
        self.block_tables = self._dev32[o[3] :].view(n, w)
        self.keep = torch.arange(n, device=device)
        self.metas = {b: self._meta(b, backend, kv_caches) for b in self.sizes}
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.num_replays = 0

    def _meta(self, b: int, backend: str, kv_caches) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(
            backend=backend,
            kv_caches=kv_caches,
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_start_loc=self.seq_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    # -- capture ---------------------------------------------------------------------
    def capture(self, forward: Callable, capture: Capture | None = None) -> None:
        """Capture every bucket, largest first (smaller ones reuse its pool)."""
        if capture is None:
            capture = cuda_capture(torch.cuda.graph_pool_handle())
        for b in reversed(self.sizes):
            self._fill(b, *_padding_inputs(b, self.block_tables.shape[1]))  # all padding
            self._replays[b] = capture(self._bucket_forward(forward, b))

    def _bucket_forward(self, forward: Callable, b: int) -> Callable[[], torch.Tensor]:
        ids, pos, keep, meta = self.input_ids[:b], self.positions[:b], self.keep[:b], self.metas[b]
        return lambda: forward(ids, pos, keep, meta)

    # -- one step ----------------------------------------------------------------------
    def prepare(
        self,
        step: StepInputs,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: np.ndarray,
    ) -> PagedAttentionMetadata | None:
        """Copy a decode-only step into the static buffers of its bucket and
        return that bucket's metadata; None (run eagerly) when it fits none.
        ``block_tables``: the step's rows of the batch's block table."""
        b = bucket_for(self.sizes, step.query_lens)
        if b is None or b not in self._replays:
            return None
        n = len(step.query_lens)
        pad = _padding_inputs(b - n, self.block_tables.shape[1])
        self._fill(
            b,
            np.concatenate([step.input_ids, pad[0]]),
            np.concatenate([step.positions, pad[1]]),
            np.concatenate([seq_lens, pad[2]]),
            np.concatenate([block_tables, pad[3]]),
            np.concatenate([slot_mapping, pad[4]]),
        )
        return self.metas[b]

    def _fill(self, b, input_ids, positions, seq_lens, block_tables, slot_mapping) -> None:
        """Write ``b`` rows of inputs into the static buffers: two copies. From
        pageable memory a copy is staged before copy_ returns, so the host
        buffers may be refilled at the next step."""
        h64, h32, o = self._host64, self._host32, self._offsets
        h64[0, :b], h64[1, :b], h64[2, :b] = input_ids, positions, slot_mapping
        h32[o[0] : o[0] + b] = seq_lens
        h32[o[1] : o[1] + b + 1] = np.arange(b + 1)  # one query token per row
        h32[o[2]] = 0
        np.cumsum(seq_lens, out=h32[o[2] + 1 : o[2] + b + 1])
        width = self.block_tables.shape[1]
        end = o[3] + b * width
        h32[o[3] : end] = block_tables.reshape(-1)
        self._dev64.copy_(torch.from_numpy(h64), non_blocking=True)
        self._dev32[:end].copy_(torch.from_numpy(h32[:end]), non_blocking=True)

    def owns(self, meta) -> bool:
        return self.metas.get(meta.seq_lens.shape[0]) is meta

    def replay(self, meta: PagedAttentionMetadata, keep: np.ndarray) -> torch.Tensor:
        """The logits rows ``keep`` (packed indices of the real rows) of the
        step ``prepare`` returned ``meta`` for; a copy, not the static output."""
        logits = self._replays[meta.seq_lens.shape[0]]()
        self.num_replays += 1
        return logits[torch.from_numpy(keep).to(self.device, non_blocking=True)]


def _up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _padding_inputs(num: int, width: int) -> tuple[np.ndarray, ...]:
    """``num`` padding rows: (input_ids, positions, seq_lens, block_tables,
    slot_mapping), each row a one-token context in the null block 0."""
    zeros = np.zeros(num, dtype=np.int64)
    return zeros, zeros, np.ones(num, dtype=np.int32), np.zeros((num, width), np.int32), zeros


def cuda_capture(pool) -> Capture:
    """The real capture: warm-up runs, then one CUDA graph in ``pool``."""

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        for _ in range(_WARMUP_RUNS):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def model_forward(runner) -> Callable:
    """The runner's model call on static inputs: its compiled decoder when it
    has one (worker/compiled.py), else the transformers forward."""
    compiled = getattr(runner, "compiled", None)
    if compiled is not None:
        return compiled

    def forward(input_ids, positions, keep, meta):
        out = runner.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            paged_attn=meta,
            use_cache=False,
            logits_to_keep=keep,
        )
        return out.logits[0]

    return forward


def capture_decode_graphs(
    runner, max_num_seqs: int, capture: Capture | None = None
) -> DecodeGraphs | None:
    """The decode graphs of a ModelRunner whose KV cache is allocated, captured
    now (None when graphs are off or the capture failed). ``capture`` replaces
    the CUDA capture (tests: run the forward on the static buffers), and then
    the device and backend checks are skipped."""
    if capture is None:
        reason = graphs_off_reason(runner)
        if reason is not None:
            logger.info("CUDA graphs: off (%s)", reason)
            return None
    graphs = DecodeGraphs(
        capture_sizes(getattr(runner, "cuda_graph_sizes", None)),
        max_num_seqs,
        runner.batch.block_table.shape[1],
        runner.block_size,
        runner.attention_backend,
        runner.kv_caches,
        runner.device,
    )
    cuda = capture is None
    free_before = torch.cuda.mem_get_info(runner.device)[0] if cuda else 0
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            graphs.capture(model_forward(runner), capture)
    except Exception as exc:  # a forward that syncs with the host cannot be captured
        logger.warning(
            "CUDA graphs: capture failed, running eagerly (%s: %s)", type(exc).__name__, exc
        )
        return None
    used = free_before - torch.cuda.mem_get_info(runner.device)[0] if cuda else 0
    logger.info(
        "CUDA graphs: captured batch sizes %s in %.1f s, %.0f MiB",
        ",".join(map(str, graphs.sizes)),
        time.perf_counter() - t0,
        used / 2**20,
    )
    return graphs
