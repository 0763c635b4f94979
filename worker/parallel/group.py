"""The tensor-parallel process group of one worker rank (torch.distributed).

Two groups over the same ranks:

- ``control`` (gloo, always): rank 0 broadcasts each message the server sent it
  (load a model, size the KV cache, run a step) so every rank runs the same
  thing in the same order.
- ``compute``: the all-reduces of the row-parallel layers and the KV-size
  agreement; NCCL on CUDA, gloo on CPU. Created when the device is known.

Every wait is bounded by ``timeout_s`` (torch.distributed's per-group
timeout); joining the group, by at least JOIN_TIMEOUT_S. Between steps the other
ranks sit in a control broadcast; so that an idle server is not mistaken for a
dead rank 0, rank 0 sends a heartbeat when it has sent nothing for
``timeout_s / 4`` seconds. A rank that died closes its sockets, so a peer's
next collective fails at once rather than at the timeout. A ``tcp://HOST:PORT``
rendezvous store listens on HOST only (rendezvous.py), not on every interface.
A broken group cannot be mended in place (a gloo or NCCL group cannot replace a
member): ranks exit, and the group is restarted whole.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenbudget.worker.parallel.rendezvous import bound_store, parse_tcp_init

logger = logging.getLogger(__name__)

HEARTBEAT = ("heartbeat", None)
JOIN_TIMEOUT_S = 300.0


class GroupBrokenError(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or the group closed."""


class TensorParallelGroup:
    def __init__(
        self, rank: int, world_size: int, init_method: str, *, timeout_s: float = 300.0
    ) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 for a process group, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"dist timeout must be > 0 seconds, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.heartbeat_s = timeout_s / 4
        # Joining may wait for ranks still starting (other hosts, slow imports):
        # at least JOIN_TIMEOUT_S. Every collective after it waits timeout_s at most.
        join_timeout = max(self.timeout, timedelta(seconds=JOIN_TIMEOUT_S))
        tcp = parse_tcp_init(init_method)
        rendezvous = (
            {"store": bound_store(*tcp, rank, world_size, join_timeout)}
            if tcp is not None
            else {"init_method": init_method}
        )
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=join_timeout, **rendezvous
        )
        self.control = dist.new_group(backend="gloo", timeout=self.timeout)
        self.compute = None
        self._compute_device: torch.device | None = None
        self.broken: BaseException | None = None
        # Rank 0: control broadcasts come from the step thread and the
        # heartbeat thread; a heartbeat goes only while no exchange is under way.
        self._lock = threading.Lock()
        self._busy = False
        self._last_send = time.monotonic()
        # Time spent in the compute all-reduces (benchmarks read and reset it).
        self.reduce_seconds = 0.0
        self.num_reduces = 0

    # -- control messages --------------------------------------------------------
    def send(self, kind: str, payload: Any = None) -> None:
        """Rank 0: broadcast a message and mark the group busy until ``done()``
        (the ranks are then running it, not waiting for a message)."""
        with self._lock:
            self._check()
            self._busy = True
            self._broadcast([(kind, payload)])

    def done(self) -> None:
        with self._lock:
            self._busy = False
            self._last_send = time.monotonic()

    def receive(self) -> tuple[str, Any]:
        """Ranks > 0: the next message from rank 0 (heartbeats skipped)."""
        while True:
            box: list[Any] = [None]
            self._broadcast(box)
            if box[0] != HEARTBEAT:
                return box[0]

    def start_heartbeat(self, on_broken) -> threading.Thread:
        """Rank 0: keep idle ranks' waits short of their timeout; ``on_broken``
        gets the error when a heartbeat cannot be sent (a rank is gone)."""

        def beat() -> None:
            while self.broken is None:
                time.sleep(min(self.heartbeat_s, 1.0))
                with self._lock:
                    if (
                        self._busy
                        or self.broken is not None
                        or time.monotonic() - self._last_send < self.heartbeat_s
                    ):
                        continue
                    try:
                        self._broadcast([HEARTBEAT])
                    except GroupBrokenError as exc:
                        on_broken(exc)
                        return
                    self._last_send = time.monotonic()

        thread = threading.Thread(target=beat, daemon=True, name="tokenbudget-tp-heartbeat")
        thread.start()
        return thread

    def gather(self, value: Any) -> list[Any] | None:
        """Collective over the control group: every rank's ``value`` in rank
        order at rank 0 (None elsewhere), e.g. the KV transfer handshakes."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object(value, out, dst=0, group=self.control)
        except Exception as exc:
            raise self._broke(exc) from exc
        return out

    def _broadcast(self, box: list[Any]) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except Exception as exc:
            raise self._broke(exc) from exc

    # -- compute -----------------------------------------------------------------
    def use_device(self, device: torch.device) -> None:
        """Collective: every rank calls it with its device (the same type)."""
        if self._compute_device is not None and self._compute_device.type == device.type:
            self._compute_device = device
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.compute = dist.new_group(backend=backend, timeout=self.timeout)
        self._compute_device = device

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (a row-parallel layer's output)."""
        start = time.perf_counter()
        try:
            dist.all_reduce(tensor, group=self.compute)
        except Exception as exc:
            raise self._broke(exc) from exc
        self.reduce_seconds += time.perf_counter() - start
        self.num_reduces += 1

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank has (the KV cache blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self._compute_device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.compute)
        except Exception as exc:
            raise self._broke(exc) from exc
        return int(t.item())

    def shard(self, net: torch.nn.Module) -> int:
        from tokenbudget.worker.parallel.sharding import shard_model

        return shard_model(net, self.rank, self.world_size, self.all_reduce)

    # -- failure -----------------------------------------------------------------
    def _broke(self, exc: BaseException) -> GroupBrokenError:
        err = (
            exc
            if isinstance(exc, GroupBrokenError)
            else GroupBrokenError(
                f"tensor-parallel group broken at rank {self.rank} of {self.world_size} (a rank "
                f"died or hung past {self.timeout.total_seconds():g} s): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )
        )
        if self.broken is None:
            self.broken = err
        return err

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken
