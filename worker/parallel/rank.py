"""One tensor-parallel rank: ``python -m tokenbudget.worker --rank R --world-size N
--dist-init tcp://HOST:PORT``.

The server talks to rank 0 only, over the ordinary ``--worker`` gRPC path
(Initialize, the ExecuteModel stream); rank 0 broadcasts every message to the
other ranks over the process group and answers alone. So the server sends one
serialised step per step whatever N is, needs no address but rank 0's (the
ranks of a multi-host group can sit on a private network), and the ranks
cannot drift apart: they run the messages in the one order rank 0 sent them.

Every rank samples from identical logits (the lm_head is replicated and its
input is the all-reduced hidden state, the same bytes on every rank) with the
same generators (rank 0 sends the global seed; per-request seeds come with the
requests), so every rank appends the same tokens to its own copy of each
sequence and feeds them back as the next inputs, as async scheduling needs;
only rank 0's output goes back to the server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.lora import LoRAConfig
from tokenbudget.core.outputs import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenbudget.proto.kv_connector import KVSendTally
from tokenbudget.worker.parallel.group import GroupBrokenError, TensorParallelGroup

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RankInit:
    """What every rank needs to load the model: Initialize's fields and the seed."""

    model: str
    dtype: str
    device: str
    attention_backend: str
    seed: int
    enforce_eager: bool | None = None
    lora_config: LoRAConfig | None = None


def rank_device(device: str, rank: int) -> str:
    """This rank's device: on CUDA, GPU ``rank % count`` unless one is named."""
    if not device:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    return device


def build_rank_worker(group: TensorParallelGroup, init: RankInit):
    from tokenbudget.worker.worker import Worker

    device = rank_device(init.device, group.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to the current GPU
    group.use_device(torch.device(device))
    return Worker(
        init.model,
        dtype=init.dtype or "auto",
        device=device,
        attention_backend=init.attention_backend or "auto",
        seed=init.seed,
        parallel=group,
        enforce_eager=init.enforce_eager,
        lora_config=init.lora_config,
    )


class DriverWorker:
    """Rank 0's worker, as the gRPC servicer drives it: each call is broadcast
    to the other ranks, then run here. Any failure leaves the group unusable
    (the ranks may be stuck mid-collective): ``on_broken`` is told, and the
    rank's process ends so the whole group can be restarted."""

    def __init__(
        self,
        group: TensorParallelGroup,
        model: str,
        *,
        dtype: str = "auto",
        device: str = "",
        attention_backend: str = "auto",
        enforce_eager: bool | None = None,
        lora_config: LoRAConfig | None = None,
        on_broken: Callable[[BaseException], None],
    ) -> None:
        from tokenbudget.worker.loader import check_supported
        from tokenbudget.core.utils.model_source import load_config
        from tokenbudget.worker.parallel.sharding import check_tensor_parallel_size

        self.group = group
        self._on_broken = on_broken
        self._kv_tally = KVSendTally(group.world_size)
        # Refused here, before any rank loads: a bad path or size leaves the group intact.
        config = load_config(model)
        check_supported(config, model)
        check_tensor_parallel_size(config.get_text_config(), group.world_size)
        init = RankInit(
            model,
            dtype,
            device,
            attention_backend,
            seed=random.getrandbits(63),
            enforce_eager=enforce_eager,
            lora_config=lora_config,
        )
        self.worker = self._collective("init", init, lambda: build_rank_worker(group, init))

    def initialize(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> KVCacheSpec:
        def run() -> KVCacheSpec:
            spec = self.worker.initialize(cache_config, scheduler_config)
            if not cache_config.kv_transfer_backend:
                return spec
            # Every rank's handshakes, in rank order (a peer's rank r writes to rank r).
            gathered = self.group.gather(spec.kv_transfer_handshakes)
            handshakes = tuple(h for per_rank in gathered for h in per_rank)
            return dataclasses.replace(spec, kv_transfer_handshakes=handshakes)

        self._kv_tally = KVSendTally(self.group.world_size)
        return self._collective("kv", (cache_config, scheduler_config), run)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        def run() -> ModelRunnerOutput:
            out = self.worker.execute_model(scheduler_output)
            if scheduler_output.kv_connector_metadata is not None:
                # A send is done once every rank wrote its share (or one failed).
                reports = self.group.gather((out.finished_sending, out.failed_sending))
                out.finished_sending, out.failed_sending = self._kv_tally.merge(reports)
            return out

        return self._collective("step", scheduler_output, run)

    def shutdown(self) -> None:
        # Local only: the other ranks drop their model at the next "init".
        self.worker.shutdown()

    def _collective(self, kind: str, payload, run):
        try:
            self.group.send(kind, payload)
            return run()
        except Exception as exc:
            if not isinstance(exc, GroupBrokenError):
                logger.error("rank 0 failed a %r message; the other ranks cannot go on", kind)
            self._on_broken(exc)
            raise
        finally:
            self.group.done()


def follow(group: TensorParallelGroup) -> int:
    """Ranks > 0: run rank 0's messages until "shutdown" (exit status 0) or
    until the group breaks or a message fails (1)."""
    worker = None
    try:
        while True:
            kind, payload = group.receive()
            if kind == "step":
                out = worker.execute_model(payload)
                if payload.kv_connector_metadata is not None:  # rank 0 merges the KV sends
                    group.gather((out.finished_sending, out.failed_sending))
            elif kind == "kv":
                spec = worker.initialize(*payload)
                if payload[0].kv_transfer_backend:  # rank 0 collects the handshakes
                    group.gather(spec.kv_transfer_handshakes)
            elif kind == "init":
                if worker is not None:
                    worker.shutdown()
                logger.info("rank %d: loading %s", group.rank, payload.model)
                worker = build_rank_worker(group, payload)
            elif kind == "shutdown":
                return 0
            else:
                raise RuntimeError(f"unknown tensor-parallel message {kind!r}")
    except Exception as exc:
        logger.error("rank %d stops: %s", group.rank, exc)
        return 1


def run_rank(args, secret: str | None) -> None:
    """The worker process of one rank (``__main__`` parsed ``args``); rank 0's
    gRPC port asks for ``secret`` when given. The rendezvous and the group's
    own connections carry no secret (and rank 0's messages are pickles): keep
    them on a network only the ranks reach."""
    import signal
    import sys

    from tokenbudget.proto.rpc.ports import BindError
    from tokenbudget.worker.grpc_worker import serve

    group = _join(args)
    if args.rank > 0:
        # No orderly teardown: destroying a broken group can block.
        sys.stdout.flush()
        os._exit(follow(group))
    stop = threading.Event()

    def on_broken(exc: BaseException) -> None:
        logger.error("%s; rank 0 stops", exc)
        stop.set()

    try:
        server, port, stop = serve(
            args.host,
            args.port,
            max_message_size=args.max_message_size,
            gc_threshold=args.gc_threshold,
            secret=secret,
            worker_factory=_driver_factory(group, on_broken),
            stop_event=stop,
        )
    except BindError as exc:
        sys.exit(f"worker: {exc}")
    group.start_heartbeat(on_broken)
    if args.parent_pid is not None:
        threading.Thread(
            target=_stop_when_orphaned,
            args=(args.parent_pid, stop),
            daemon=True,
            name="tokenbudget-tp-parent",
        ).start()
    # The readiness line of every worker: the other ranks have joined by now.
    print(f"tokenbudget worker listening on {args.host}:{port}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if group.broken is None:
        try:
            group.send("shutdown")
        except GroupBrokenError:
            pass
    server.stop(grace=2).wait()
    sys.stdout.flush()
    os._exit(1 if group.broken is not None else 0)


def _join(args) -> TensorParallelGroup:
    """This rank's group, once every rank has joined; exits if it cannot join."""
    import sys

    from tokenbudget.proto.rpc.ports import check_port_free

    if args.rank == 0:
        check_port_free(args.host, args.port)  # before waiting for the other ranks
    logging.getLogger(__name__).info(
        "rank %d of %d: joining %s", args.rank, args.world_size, args.dist_init
    )
    try:
        return TensorParallelGroup(
            args.rank, args.world_size, args.dist_init, timeout_s=args.dist_timeout
        )
    except Exception as exc:
        sys.exit(f"worker: rank {args.rank} could not join {args.dist_init}: {exc}")


def _driver_factory(
    group: TensorParallelGroup, on_broken: Callable[[BaseException], None]
) -> Callable[..., DriverWorker]:
    """serve's worker_factory on rank 0: a DriverWorker over ``group``."""

    def factory(
        model: str,
        dtype: str,
        device: str,
        attention_backend: str,
        *,
        enforce_eager: bool | None,
        lora_config: LoRAConfig | None,
    ) -> DriverWorker:
        return DriverWorker(
            group,
            model,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            lora_config=lora_config,
            on_broken=on_broken,
        )

    return factory


def _stop_when_orphaned(parent_pid: int, stop: threading.Event) -> None:
    """Set ``stop`` once the process that started this rank is gone (this
    process is then adopted by another: its parent pid changes)."""
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            logger.error(
                "the engine that started this rank (pid %d) is gone; rank 0 stops", parent_pid
            )
            stop.set()
