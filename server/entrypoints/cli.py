"""``server``: serve a model over gRPC (Generation + health + reflection).

    server --model PATH_OR_ID --port 50051
    server                                  # the built-in tiny demo model (random weights)
    server --model PATH --worker h1:50061   # drive a remote worker (python -m tokenbudget.worker)

SIGTERM (or Ctrl-C) drains: new requests get UNAVAILABLE, requests in flight
finish (up to --drain-timeout seconds, then they are aborted), exit status 0.
A port another process listens on is refused before the model loads.

The gRPC and metrics ports listen on 127.0.0.1 unless --host says otherwise;
--tls-cert/--tls-key (and --tls-client-ca) serve TLS, --api-key requires
"authorization: Bearer KEY" on every call but health checks.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import logging
import sys
from importlib import metadata
from typing import NoReturn

from tokenbudget.core.utils.gc_policy import configure_gc
from tokenbudget.server.engine.args import GROUPS
from tokenbudget.server.engine.flags import engine_flags
from tokenbudget.server.entrypoints.grpc.server import serve
from tokenbudget.server.entrypoints.server_flags import AFTER_ENGINE, SERVER_FLAGS
from tokenbudget.server.entrypoints.vllm_flags import add_vllm_flags, apply_vllm_flags

logger = logging.getLogger("tokenbudget.server")


def build_parser() -> argparse.ArgumentParser:
    """The engine's flags (derived from EngineArgs and the config fields) and
    the server's own (server_flags.SERVER_FLAGS), in the groups of GROUPS."""
    p = _Parser(
        prog="server",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s (tokenbudget) {metadata.version('tokenbudget')}",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="the model, as `vllm serve MODEL` takes it (same as --model)",
    )
    engine = engine_flags()
    for title in GROUPS:
        group = p.add_argument_group(title)
        ours = [(names, kwargs) for g, names, kwargs in SERVER_FLAGS if g == title]
        theirs = [(names, kwargs) for g, names, kwargs in engine if g == title]
        for names, kwargs in theirs + ours if title in AFTER_ENGINE else ours + theirs:
            group.add_argument(*names, **kwargs)
    add_vllm_flags(p)
    return p


class _Parser(argparse.ArgumentParser):
    """Errors in one line, with the closest flag for a typo, and no usage dump
    (``server --help`` has it); prefixes of flags are not taken for them."""

    def error(self, message: str) -> NoReturn:
        flags = [o for o in self._option_string_actions if o.startswith("--")]
        guesses = [
            close
            for word in message.split()
            if word.startswith("--")
            for close in difflib.get_close_matches(word.split("=")[0], flags, n=1)
        ]
        hint = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
        print(f"{self.prog}: error: {' '.join(message.split())}{hint}", file=sys.stderr, flush=True)
        sys.exit(2)


def engine_args_from(args: argparse.Namespace):
    """The EngineArgs of the parsed flags; refuses (UnsupportedArgument, a
    ValueError) what cannot be honoured, before anything loads."""
    from tokenbudget.server.engine.args import EngineArgs, UnsupportedArgument

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(
                f"the model is given twice ({args.model_tag!r} and --model "
                f"{args.model!r}); give it once"
            )
        args.model = args.model_tag
    apply_vllm_flags(args)
    engine_args = EngineArgs.from_cli_args(args)
    check_server_flags(args)
    if args.worker and args.tensor_parallel_size > 1:
        raise UnsupportedArgument(
            "--tensor-parallel-size with --worker",
            "ranks on other hosts are started with "
            "`python -m tokenbudget.worker --rank R --world-size N --dist-init URL`; give "
            "rank 0's address to --worker and leave --tensor-parallel-size at 1",
        )
    if args.worker:
        # Initialize carries the model path, dtype, device and attention backend only.
        for flag, given in (
            ("--revision", args.revision is not None),
            ("--download-dir", args.download_dir is not None),
            ("--trust-remote-code", args.trust_remote_code),
            ("--kv-cache-dtype", args.kv_cache_dtype != "auto"),
        ):
            if given:
                raise UnsupportedArgument(
                    f"{flag} with --worker",
                    "a remote worker is told "
                    "only the model path, dtype, device and attention "
                    "backend; give --model a local folder it can read",
                )
    return engine_args


def check_server_flags(args: argparse.Namespace) -> None:
    """Refuse (ValueError naming the flag) security and worker flags that
    cannot work, before anything loads: unreadable TLS files or secrets, a
    secret or timeout without --worker."""
    from tokenbudget.server.entrypoints.grpc.security import server_credentials
    from tokenbudget.proto.rpc.auth import read_secret_file

    server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if args.worker_step_timeout < 0:
        raise ValueError(f"--worker-step-timeout must be >= 0, got {args.worker_step_timeout}")
    if args.max_id_bytes < 1:
        raise ValueError(f"--max-id-bytes must be >= 1, got {args.max_id_bytes}")
    if args.worker_hang_timeout < 0:
        raise ValueError(f"--worker-hang-timeout must be >= 0, got {args.worker_hang_timeout}")
    if not args.worker_connect_timeout > 0:
        raise ValueError(f"--worker-connect-timeout must be > 0, got {args.worker_connect_timeout}")
    if args.worker_secret_file is not None:
        disaggregated = args.disaggregation_mode != "null" or args.kv_transfer_config is not None
        if not args.worker and not disaggregated:
            raise ValueError(
                "--worker-secret-file needs --worker or --disaggregation-mode: it authenticates "
                "the server to remote workers and decode servers to a prefill's bootstrap port"
            )
        read_secret_file(args.worker_secret_file)
    if args.max_concurrent_rpcs < 1:
        raise ValueError(f"--max-concurrent-rpcs must be >= 1, got {args.max_concurrent_rpcs}")
    if args.openai_port is not None:
        _check_openai_port(args)


def _check_openai_port(args: argparse.Namespace) -> None:
    from tokenbudget.proto.rpc.ports import BindError, check_port_free
    from tokenbudget.server.entrypoints.openai_gateway import check_installed

    check_installed()
    if args.api_key is not None or args.tls_cert is not None:
        raise ValueError(
            "--openai-port with --api-key or --tls-cert is not supported: the "
            "gateway connects to this server without them; run sglang-router "
            "yourself with its own TLS and API key settings"
        )
    if args.openai_port == args.port or args.openai_port < 1:
        raise ValueError(
            f"--openai-port must be a free port other than --port, got {args.openai_port}"
        )
    try:
        check_port_free(args.host, args.openai_port)
    except BindError as exc:
        raise ValueError(f"--openai-port: {exc}") from None


def build_engine(args: argparse.Namespace, metrics=None):
    """An AsyncEngine for the parsed flags (loads the model, sizes the KV
    cache): the demo model when no --model is given, the port checked before
    the weights load."""
    from functools import partial

    from tokenbudget.proto.rpc.ports import check_port_free
    from tokenbudget.server.engine.factory import build_async_engine
    from tokenbudget.server.entrypoints.demo import ensure_demo_model

    engine_args = engine_args_from(args)
    is_demo = args.model is None
    engine_args.model = args.model or ensure_demo_model(args.demo_dir)
    if is_demo:
        logger.warning(
            "no --model given: serving the built-in DEMO model from %s "
            "(tiny Qwen3 with RANDOM weights; its text is gibberish)",
            engine_args.model,
        )
    return build_async_engine(
        engine_args,
        metrics,
        placement(args),
        is_demo=is_demo,
        before_load=partial(check_port_free, args.host, args.port),
        record_trace=bool(args.record_trace),
    )


def placement(args: argparse.Namespace):
    """Where the model runs, from the workers flags (engine/factory.py Placement)."""
    from tokenbudget.proto.rpc.auth import read_secret_file
    from tokenbudget.server.engine.factory import Placement

    secret = args.worker_secret_file
    return Placement(
        workers=tuple(args.worker),
        max_message_size=args.max_message_size,
        secret=read_secret_file(secret) if secret else None,
        connect_timeout=args.worker_connect_timeout,
        step_timeout=args.worker_step_timeout,
        hang_timeout=args.worker_hang_timeout,
        torch_threads=args.torch_threads or None,
        host=args.host,
    )


def configure_logging(args: argparse.Namespace) -> None:
    """--log-level for tokenbudget's loggers; other libraries log at info and above."""
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(
        level=max(level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("tokenbudget").setLevel(level)


def make_metrics(args: argparse.Namespace):
    """The engine's observer: Prometheus metrics and the stats / request log lines."""
    from tokenbudget.server.engine.metrics import EngineMetrics

    return EngineMetrics(
        args.served_model_name or args.model or "demo",
        log_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
        log_requests=args.enable_log_requests,
    )


def _serve_metrics(args: argparse.Namespace, metrics) -> None:
    try:
        port = metrics.serve(args.metrics_port, args.host)
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        sys.exit(f"server: cannot serve metrics on {args.host}:{args.metrics_port}: {reason}")
    logger.info("Prometheus metrics on http://%s:%d/metrics", args.host, port)


def _refuse(message: object) -> NoReturn:
    """A configuration error: one line on stderr, exit status 2 (as argparse's)."""
    print(f"server: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def _start_busy_poll() -> None:
    from tokenbudget.worker import idle_poll

    try:
        cpus = idle_poll.start()
    except (RuntimeError, ValueError) as exc:
        sys.exit(f"server: --busy-poll: {exc}")
    logger.info("busy polling: an idle-priority spinning thread on each of CPUs %s", cpus)


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before serving (once serving, it drains)
        print("server: interrupted during start-up", file=sys.stderr, flush=True)
        sys.exit(130)


def _main(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)
    try:
        engine_args_from(args)
    except ValueError as exc:
        _refuse(exc)
    configure_logging(args)
    if args.gc_threshold < 1:
        sys.exit(f"server: --gc-threshold must be >= 1, got {args.gc_threshold}")
    if args.gil_switch_interval_ms <= 0:
        sys.exit(f"server: --gil-switch-interval-ms must be > 0, got {args.gil_switch_interval_ms}")
    if args.log_stats_interval < 0:
        sys.exit(f"server: --log-stats-interval must be >= 0, got {args.log_stats_interval}")
    if args.torch_threads < 0:
        sys.exit(f"server: --torch-threads must be >= 0, got {args.torch_threads}")
    import torch

    from tokenbudget.core.utils.cpus import server_compute_threads

    torch.set_num_threads(args.torch_threads or server_compute_threads())
    from tokenbudget.proto.rpc.ports import BindError

    metrics = make_metrics(args)
    try:
        if args.metrics_port is not None:
            _serve_metrics(args, metrics)
        sys.setswitchinterval(args.gil_switch_interval_ms / 1000)
        try:
            engine = build_engine(args, metrics)
        except ValueError as exc:  # a bad setting or a checkpoint that cannot be read
            _refuse(exc)
        except ConnectionError as exc:  # a --worker that cannot be reached or refuses us
            sys.exit(f"server: {exc}")
        if args.busy_poll:
            _start_busy_poll()
        # Start-up is done: freeze what it built and keep collections out of the steps.
        policy = configure_gc(args.gc_threshold)
        logger.info(
            "gc: froze %d start-up objects; thresholds %s", policy.frozen, policy.thresholds
        )
        sys.exit(serve(args, engine))
    except BindError as exc:  # the port is taken: say so, without a traceback
        sys.exit(f"server: {exc}")
    finally:
        metrics.close()


if __name__ == "__main__":
    main()
