"""``python -m tokenbudget.worker --host H --port P``: serve one worker over gRPC.

The server (``server --worker H:P``) sends the model path and cache/scheduler
configuration on connect; the path must be readable on this machine.

Whoever reaches a worker's port can load any model path on it and stop it, so
it listens on 127.0.0.1 by default. Across machines, give the server and every
worker the same ``--worker-secret-file``: calls without the secret are refused
(UNAUTHENTICATED). A non-loopback ``--host`` without a secret is refused at
start unless ``--allow-unauthenticated`` says the network is trusted.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from importlib import metadata
from typing import Any

from tokenbudget.core.utils.gc_policy import DEFAULT_GEN0_THRESHOLD


TENSOR_PARALLEL = "tensor parallelism"
# (group, option strings, add_argument keywords), added in this order: the
# group None is the parser itself.
Flag = tuple[str | None, tuple[str, ...], dict[str, Any]]
FLAGS: list[Flag] = [
    (
        None,
        ("--host",),
        dict(
            default="127.0.0.1",
            help="address to bind (default %(default)s: only this machine can "
            "connect); another address needs --worker-secret-file or "
            "--allow-unauthenticated",
        ),
    ),
    (
        None,
        ("--port",),
        dict(
            type=int,
            default=50061,
            help="port to bind; 0 picks a free one (default %(default)s). A port "
            "another process listens on is refused",
        ),
    ),
    (
        None,
        ("--worker-secret-file",),
        dict(
            default=None,
            metavar="PATH",
            help="a file holding a shared secret; every call must present it "
            "(the server reads the same file with its own --worker-secret-file)",
        ),
    ),
    (
        None,
        ("--allow-unauthenticated",),
        dict(
            action="store_true",
            help="serve on a non-loopback --host without a secret: anyone who "
            "reaches the port can run any model path and stop the worker. Only "
            "on a network you trust",
        ),
    ),
    (
        None,
        ("--max-message-size",),
        dict(type=int, default=256 << 20, help="largest gRPC message in bytes (default 256 MiB)"),
    ),
    (
        None,
        ("--threads",),
        dict(
            type=int,
            default=0,
            help="torch intra-op threads (default 0: one per CPU this process may run on, "
            "os.sched_getaffinity)",
        ),
    ),
    (
        None,
        ("--gc-threshold",),
        dict(
            type=int,
            default=DEFAULT_GEN0_THRESHOLD,
            help="Python collector's generation-0 threshold, set once Initialize "
            "has loaded the model and the heap is frozen, like the server's "
            "--gc-threshold (default %(default)s; CPython's own is 700)",
        ),
    ),
    (
        TENSOR_PARALLEL,
        ("--rank",),
        dict(
            type=int,
            default=0,
            help="this rank (default %(default)s); only rank 0 listens on --host/--port",
        ),
    ),
    (
        TENSOR_PARALLEL,
        ("--world-size",),
        dict(
            type=int,
            default=1,
            help="number of ranks = tensor-parallel size (default %(default)s: no group)",
        ),
    ),
    (
        TENSOR_PARALLEL,
        ("--dist-init",),
        dict(
            default=None,
            metavar="URL",
            help="torch.distributed rendezvous, the same on every rank, e.g. "
            "tcp://RANK0_HOST:29500",
        ),
    ),
    (
        TENSOR_PARALLEL,
        ("--dist-timeout",),
        dict(
            type=float,
            default=300.0,
            metavar="SECONDS",
            help="longest wait in any collective once joined (joining waits at least "
            "300 s): a rank gone or hung longer breaks the group and every rank exits "
            "(default %(default)s)",
        ),
    ),
    # Set by the launcher of --tensor-parallel-size: rank 0 stops when that
    # process is gone.
    (TENSOR_PARALLEL, ("--parent-pid",), dict(type=int, default=None, help=argparse.SUPPRESS)),
    (
        None,
        ("--log-level",),
        dict(
            default="info",
            type=str.lower,
            choices=["debug", "info", "warning", "error"],
            help="level of tokenbudget's own log lines; other libraries log at "
            "info and above (default %(default)s)",
        ),
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenbudget.worker", description=__doc__)
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s (tokenbudget) {metadata.version('tokenbudget')}",
    )
    groups = {
        None: parser,
        TENSOR_PARALLEL: parser.add_argument_group(
            TENSOR_PARALLEL,
            "one model sharded over --world-size ranks (processes or hosts), "
            "each started with this command; the server drives rank 0 (server --worker "
            "RANK0_HOST:PORT), which fans every step out to the others",
        ),
    }
    for group, names, kwargs in FLAGS:
        groups[group].add_argument(*names, **kwargs)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.gc_threshold < 1:
        sys.exit(f"worker: --gc-threshold must be >= 1, got {args.gc_threshold}")
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(
        level=max(level, logging.INFO), format="%(asctime)s %(levelname)s worker: %(message)s"
    )
    logging.getLogger("tokenbudget").setLevel(level)
    secret = _secret(args)  # before the slow imports: a refusal is immediate
    import torch

    from tokenbudget.proto.rpc.ports import BindError
    from tokenbudget.worker.grpc_worker import serve

    from tokenbudget.core.utils.cpus import available_cpus

    torch.set_num_threads(args.threads or available_cpus())
    if args.world_size > 1 or args.dist_init:
        if args.dist_init is None or not 0 <= args.rank < args.world_size:
            sys.exit(
                "worker: a tensor-parallel rank needs --dist-init URL, --world-size N >= 2 "
                f"and 0 <= --rank < N (got --rank {args.rank}, --world-size "
                f"{args.world_size}, --dist-init {args.dist_init})"
            )
        from tokenbudget.worker.parallel.rank import run_rank

        run_rank(args, secret)
        return
    try:
        server, port, stop = serve(
            args.host,
            args.port,
            max_message_size=args.max_message_size,
            gc_threshold=args.gc_threshold,
            secret=secret,
        )
    except BindError as exc:
        sys.exit(f"worker: {exc}")
    # The line tests and scripts wait for (the port may have been picked by the OS).
    print(f"tokenbudget worker listening on {args.host}:{port}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()


def _secret(args: argparse.Namespace) -> str | None:
    """The shared secret, or None where serving without one is allowed; exits otherwise."""
    from tokenbudget.proto.rpc.auth import is_loopback, read_secret_file

    if args.worker_secret_file is not None:
        try:
            return read_secret_file(args.worker_secret_file)
        except ValueError as exc:
            sys.exit(f"worker: {exc}")
    if is_loopback(args.host):
        return None
    if not args.allow_unauthenticated:
        sys.exit(
            f"worker: refusing to listen on {args.host} without --worker-secret-file: "
            "anyone who reaches the port could load any model path and stop the worker "
            "(pass --allow-unauthenticated on a network you trust)"
        )
    logging.getLogger("tokenbudget.worker").warning(
        "UNAUTHENTICATED worker on %s: anyone who reaches port %d can run any model path on "
        "this machine and shut the worker down (--allow-unauthenticated)",
        args.host,
        args.port,
    )
    return None


if __name__ == "__main__":
    main()
