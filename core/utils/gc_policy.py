"""Garbage-collector policy of an engine process (what vLLM and SGLang do).

The engine's heap is large and long-lived (modules, model, KV block pool,
running requests), while a step allocates many short-lived containers (one
list per sampled row, dicts per step). With CPython's defaults (700, 10, 10)
a step trips several young collections whose survivors are promoted, and
every so often a full collection walks the whole heap inside a step
(hundreds of µs at 1024 running requests). So, once start-up is done:

* ``gc.collect(); gc.freeze()`` moves everything alive into the permanent
  generation, which no collection scans again (vLLM freezes its heap after
  engine start-up). Cyclic garbage is still collected; only the start-up
  objects become immortal, and those live as long as the process anyway.
* generation 0 collects every ``gen0_threshold`` net allocations instead of
  700 (SGLang's ``--gc-threshold``): a step's short-lived objects are freed
  by reference counting before a collection sees them, so fewer of them are
  promoted and full collections become rare. Generations 1 and 2 keep their
  thresholds.

Never disable the collector: a reference cycle per step would then leak.

The threshold counts objects, not bytes: a few cycles holding large request
payloads (a refused 2 MB prompt, an image) would wait for thousands of other
allocations, and with few of those (a server refusing requests while
otherwise idle) grow the heap by gigabytes. So the services never refuse by
raising through grpc (server/entrypoints/grpc/errors.py: that exception kept the request
in a cycle), and they run a collection once refused requests add up to
256 MiB (server/entrypoints/grpc/limits.py: ``RefusedBytes``), in case a
library still builds such a cycle; the frozen start-up heap is not scanned,
so it costs little.

``configure_gc`` also has ``gc.unfreeze()`` run at interpreter exit. The
collections during shutdown skip the permanent generation, so cycles frozen
there are never freed; nanobind then reports triton's objects (imported
while the model loads) as leaked: 27 ``nanobind: leaked ...`` lines on every
exit, tests included.
"""

from __future__ import annotations

import atexit
import gc
from dataclasses import dataclass

# Large enough that one step's short-lived containers (about two per running
# request at 1024 requests) fit between collections; small enough that a
# young collection stays a fraction of a millisecond.
DEFAULT_GEN0_THRESHOLD = 20_000


@dataclass(frozen=True, slots=True)
class GCPolicy:
    """What configure_gc did: the thresholds now in force and the number of
    objects it froze."""

    thresholds: tuple[int, int, int]
    frozen: int


def configure_gc(gen0_threshold: int = DEFAULT_GEN0_THRESHOLD) -> GCPolicy:
    """Call once, after the model and engine are built and before serving:
    collects, freezes the surviving heap and sets generation 0's threshold."""
    if gen0_threshold < 1:
        raise ValueError(f"gen0_threshold must be >= 1, got {gen0_threshold}")
    atexit.unregister(gc.unfreeze)  # registered once, however often this runs
    atexit.register(gc.unfreeze)
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
    return GCPolicy(thresholds=gc.get_threshold(), frozen=gc.get_freeze_count())
