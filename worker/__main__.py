"""``python -m tokenbudget.worker --host H --port P``: serve one worker over gRPC.

The server (``server --worker H:P``) sends the model path and cache/scheduler
configuration on connect; the path must be readable on this machine.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from importlib import metadata

from tokenbudget.core.gc_policy import DEFAULT_GEN0_THRESHOLD


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenbudget.worker", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s (tokenbudget) {metadata.version('tokenbudget')}")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=50061,
                        help="port to bind; 0 picks a free one (default %(default)s). A port "
                        "another process listens on is refused")
    parser.add_argument("--max-message-size", type=int, default=256 << 20,
                        help="largest gRPC message in bytes (default 256 MiB)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default %(default)s)")
    parser.add_argument("--gc-threshold", type=int, default=DEFAULT_GEN0_THRESHOLD,
                        help="Python collector's generation-0 threshold, set once Initialize "
                        "has loaded the model and the heap is frozen, like the server's "
                        "--gc-threshold (default %(default)s; CPython's own is 700)")
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["debug", "info", "warning", "error"],
                        help="level of tokenbudget's own log lines; other libraries log at "
                        "info and above (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.gc_threshold < 1:
        sys.exit(f"worker: --gc-threshold must be >= 1, got {args.gc_threshold}")
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=max(level, logging.INFO),
                        format="%(asctime)s %(levelname)s worker: %(message)s")
    logging.getLogger("tokenbudget").setLevel(level)
    import torch

    from tokenbudget.worker.grpc_worker import BindError, serve

    torch.set_num_threads(args.threads)
    try:
        server, port, stop = serve(args.host, args.port, max_message_size=args.max_message_size,
                                   gc_threshold=args.gc_threshold)
    except BindError as exc:
        sys.exit(f"worker: {exc}")
    # The line tests and scripts wait for (the port may have been picked by the OS).
    print(f"tokenbudget worker listening on {args.host}:{port}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()


if __name__ == "__main__":
    main()
