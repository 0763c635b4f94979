"""The ``cpu`` attention backend: our C++ kernel reading the paged KV cache in place.

``csrc/paged_attention_cpu.cpp`` walks each request's context through its
block table with an online softmax: no per-layer gather of the context into a
packed tensor and no padding of decode groups (what the ``sdpa`` backend
pays for). It is built on first use with ``torch.utils.cpp_extension.load``
(g++ and ninja, ``-O3 -march=native``, OpenMP from torch's own runtime) into
torch's extension folder (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), where later processes find it built.

``cpu_kernel_problem()`` says why the kernel cannot be used here (no
compiler, a build error, a wrong answer on a tiny batch), or None; the
backend choice (attention_select.resolve_backend) falls back to SDPA on it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from tokenbudget.worker.attention import (
    PagedAttentionMetadata,
    _sdpa_attention,
    allocate_kv_caches,
    build_metadata,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
# Built into the same library: packed_linear's kernel for a few rows, and the
# idle-priority spinners of worker/idle_poll.py.
SOURCES = (SOURCE, SOURCE.parent / "small_rows_linear.cpp", SOURCE.parent / "idle_poll.cpp")
# -march=native: the build is for this machine's vector units. The build's
# folder is named by a hash of the CPU's flags, the torch it links against, the
# flags and the source, so a cache shared by different machines or virtual
# environments never hands one another's build, and an edited source rebuilds.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
DTYPES = (torch.float32, torch.bfloat16)


def _build_folder() -> Path:
    """Where the kernel is built: a folder of its own in torch's extension folder."""
    try:
        cpu = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        import platform

        cpu = platform.processor() or platform.machine()
    key = "\n".join([cpu, torch.__version__, str(Path(torch.__file__).parent), *CFLAGS])
    digest = hashlib.sha1(key.encode() + b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    # torch.utils.cpp_extension's default root, computed without importing it (~0.3 s).
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    )
    return Path(root) / f"tokenbudget_paged_attention_cpu_{digest}"


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the ninja package's own (our
    dependency) is not on it when a virtual environment's python runs unactivated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, os.environ.get("PATH")]))


@functools.cache
def _build() -> str | None:
    """Build (or find built) and load the kernel once per process: why not, or None."""
    folder = _build_folder()
    library = folder / f"{folder.name}.so"
    start = time.perf_counter()
    try:
        # Built before (and no build under way: cpp_extension holds ``lock`` while
        # it builds): load it, without cpp_extension, ninja or a compiler.
        if library.exists() and not (folder / "lock").exists():
            torch.ops.load_library(str(library))
            return None
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=folder.name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja, a compile or link error, a load error
        return f"the C++ kernel did not build ({type(exc).__name__}: {_first_cause(exc)})"
    logger.info("attention: cpu kernel built in %.1f s (%s)", time.perf_counter() - start, folder)
    return None


def _first_cause(exc: Exception) -> str:
    """The line of a build failure that says what went wrong: ninja's log
    starts with the whole compiler command line, the cause comes after."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for key in ("error:", "not found", "No such file"):
        hit = next((line for line in lines if key in line), None)
        if hit:
            return hit[:300]
    return lines[0][:300] if lines else type(exc).__name__


@functools.cache
def cpu_kernel_problem() -> str | None:
    """Why the ``cpu`` backend cannot run in this process, or None when its
    kernel builds, loads and equals the SDPA path on a tiny paged batch (a
    decode and a chunk over a cached context, GQA). Cached for the process."""
    problem = _build()
    if problem is not None:
        return problem
    try:
        got, want = _self_check()
    except Exception as exc:
        return f"the C++ kernel's self-check failed ({type(exc).__name__}: {exc})"
    if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        return "the C++ kernel's self-check gave a wrong result"
    return None


@functools.cache
def load_cpu_ops() -> str | None:
    """Load our C++ ops (paged_attention, packed_linear) and register the
    shape function a compiled trace needs for packed_linear: why not, or None."""
    problem = _build()
    if problem is None:
        torch.library.register_fake("tokenbudget_cpu::packed_linear")(_packed_linear_shape)
    return problem


def _packed_linear_shape(x, weight, packed, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@functools.cache
def _kernel():
    problem = _build()
    if problem is not None:
        raise RuntimeError(f"attention backend 'cpu': {problem}")
    return torch.ops.tokenbudget_cpu.paged_attention.default


def attend_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: PagedAttentionMetadata,
    layer_idx: int,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """One layer of a compiled step in one C++ call: the step's K/V written
    into layer ``layer_idx``'s cache, then paged_attention with ``meta``'s
    window and chunk. query [1, H, T, D], key/value [1, Hkv, T, D] ->
    [1, T, H, D]: paged_attention_forward's result, without its dozen
    Python-level dispatches per layer."""
    return _attend_step()(
        query,
        key,
        value,
        meta.kv_caches[layer_idx],
        meta.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        meta.window,
        softcap,
        meta.chunk,
    )


@functools.cache
def _attend_step():
    _kernel()  # built and loaded, or why not
    return torch.ops.tokenbudget_cpu.attend_step.default


def _self_check() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, head_dim = 4, 2, 16
    (cache,) = allocate_kv_caches(
        1, 8, block_size, num_kv_heads, head_dim, torch.float32, torch.device("cpu")
    )
    cache.normal_(generator=gen)
    query_lens, seq_lens = np.array([1, 3]), np.array([6, 9])
    tables = np.array([[5, 2, 0], [1, 7, 3]], dtype=np.int32)
    q = torch.randn(4, 4, head_dim, generator=gen)
    meta = build_metadata(
        "sdpa", [cache], block_size, query_lens, seq_lens, tables, np.zeros(4, np.int64), q.device
    )
    return paged_attention(q, cache[0], cache[1], meta, None), _sdpa_attention(q, cache, meta, None)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float | None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """attention.paged_kernel's contract: q [T, H, D], caches
    [num_blocks, block_size, Hkv, D] -> [T, H, D] in q's dtype.
    ``sliding_window``: each query sees its last W positions (itself
    included); ``chunk``: a query at position p sees keys from
    ``p // chunk * chunk`` on (both may hold: the later bound wins);
    ``softcap``: scores become ``c * tanh(s / c)`` before softmax."""
    if q.dtype != k_cache.dtype:
        q = q.to(k_cache.dtype)
    return _kernel()(
        q,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        q.shape[-1] ** -0.5 if scale is None else scale,
        int(sliding_window or 0),
        float(softcap or 0.0),
        int(chunk or 0),
    )
