"""The ``server`` flags that are not engine settings: where it listens, its
security, its logging and its workers. Engine settings have their flags
derived from their fields (server/engine/flags.py ``engine_flags``); a row here
is (group, option strings, add_argument keywords), listed in that group
before the engine's flags (after them in the groups of AFTER_ENGINE)."""

from __future__ import annotations

from typing import Any

from tokenbudget.core.config import KV_CACHE
from tokenbudget.core.utils.gc_policy import DEFAULT_GEN0_THRESHOLD
from tokenbudget.server.engine.args import LOGGING, MODEL, SERVER, WORKERS

Flag = tuple[str, tuple[str, ...], dict[str, Any]]
# Groups led by an engine flag (--model, --block-size).
AFTER_ENGINE = (MODEL, KV_CACHE)

SERVER_FLAGS: list[Flag] = [
    (
        MODEL,
        ("--torch-threads",),
        dict(
            type=int,
            default=0,
            help="torch intra-op threads on CPU (default 0: one per CPU this process may "
            "run on, os.sched_getaffinity, but one, left to the event loop, the engine "
            "thread and a gateway beside it, so `taskset -c 0-4 server ...` gets 4; with "
            "--tensor-parallel-size N each rank gets a 1/N share)",
        ),
    ),
    (
        MODEL,
        ("--demo-dir",),
        dict(
            default=None,
            help="where the demo model is built and cached (default "
            "$TOKENBUDGET_CACHE/demo or ~/.cache/tokenbudget/demo)",
        ),
    ),
    (
        SERVER,
        ("--host",),
        dict(
            default="127.0.0.1",
            help="address the gRPC and metrics ports bind (default "
            "%(default)s: only this machine can connect; --host 0.0.0.0 serves every interface)",
        ),
    ),
    (
        SERVER,
        ("--port",),
        dict(
            type=int,
            default=50051,
            help="gRPC port; 0 picks a free one (default %(default)s). A "
            "port another process listens on is refused",
        ),
    ),
    (
        SERVER,
        ("--max-message-size",),
        dict(
            type=int,
            default=64 << 20,
            help="largest request message in bytes; larger ones get "
            "RESOURCE_EXHAUSTED (default 64 MiB)",
        ),
    ),
    (
        SERVER,
        ("--max-id-bytes",),
        dict(
            type=int,
            default=256,
            metavar="BYTES",
            help="the longest request_id, tenant and cache_salt a client may send, in UTF-8 "
            "bytes; they must also be printable (no newline or control character). Others are "
            "refused with INVALID_ARGUMENT naming the field (default %(default)s)",
        ),
    ),
    (
        SERVER,
        ("--max-concurrent-rpcs", "--grpc-threads"),
        dict(
            type=int,
            default=512,
            help="the most model calls (Generate, ours and the SGLang "
            "gateway's, and Embed) in flight; more are refused at once with RESOURCE_EXHAUSTED. "
            "Health checks, GetStats and GetModelInfo are always answered (default %(default)s; "
            "all streams share one asyncio event loop, --grpc-threads is the old name)",
        ),
    ),
    (
        SERVER,
        ("--openai-port",),
        dict(
            type=int,
            default=None,
            metavar="PORT",
            help="also serve OpenAI HTTP (/v1/chat/"
            "completions, /v1/embeddings, ...) on PORT of --host: starts the SGLang model gateway "
            "(pip install 'tokenbudget[openai]') in front of this server and stops it on shutdown "
            "(README: OpenAI HTTP in one command)",
        ),
    ),
    (
        SERVER,
        ("--metrics-port",),
        dict(
            type=int,
            default=None,
            help="serve Prometheus metrics at http://HOST:PORT/metrics, "
            "HOST being --host (default: off)",
        ),
    ),
    (
        SERVER,
        ("--drain-timeout",),
        dict(
            type=float,
            default=30.0,
            help="seconds SIGTERM waits for requests in flight (default %(default)s)",
        ),
    ),
    (
        SERVER,
        ("--record-trace",),
        dict(
            metavar="PATH",
            default=None,
            help="record every finished request's arrival time, "
            "prompt and output lengths, tenant, SLO targets and prompt block hashes (no text, no "
            "token ids) and write them to PATH at exit, for `python -m tokenbudget.server.sim` to "
            "replay",
        ),
    ),
    (
        SERVER,
        ("--gil-switch-interval-ms",),
        dict(
            type=float,
            default=1.0,
            help="how long a Python thread may hold the GIL while another "
            "waits (default %(default)s; CPython's own is 5). The engine thread must send the next "
            "step while the event loop streams the last step's tokens; waiting up to 5 ms for the "
            "GIL there leaves a remote worker idle",
        ),
    ),
    (
        SERVER,
        ("--busy-poll",),
        dict(
            action="store_true",
            help="keep this process's CPUs from going idle between steps, as vLLM's "
            "busy-polling engine core does: one spinning thread per CPU at idle priority "
            "(SCHED_IDLE: it runs only when nothing else wants that CPU and yields at once). "
            "On a virtual machine an idle vCPU halts, and waking it costs a hypervisor trip "
            "and cold caches; serving one stream on 2 vCPUs this lowered TPOT by about 15%%. "
            "The CPUs then show 100%% busy. Needs the C++ extension of the cpu attention "
            "backend (g++)",
        ),
    ),
    (
        SERVER,
        ("--gc-threshold",),
        dict(
            type=int,
            default=DEFAULT_GEN0_THRESHOLD,
            help="Python collector's generation-0 "
            "threshold, set after start-up when the heap is frozen (default %(default)s; CPython's "
            "own is 700)",
        ),
    ),
    (
        SERVER,
        ("--api-key",),
        dict(
            default=None,
            help="require metadata 'authorization: Bearer API_KEY' on every call "
            "(UNAUTHENTICATED otherwise); grpc.health.v1 stays open for probes. Send it over TLS, "
            "or on loopback only",
        ),
    ),
    (
        SERVER,
        ("--tls-cert", "--ssl-certfile"),
        dict(
            default=None,
            metavar="PEM",
            help="serve TLS with this certificate (chain) and --tls-key (--ssl-certfile: vLLM's "
            "name)",
        ),
    ),
    (
        SERVER,
        ("--tls-key", "--ssl-keyfile"),
        dict(
            default=None,
            metavar="PEM",
            help="the private key of --tls-cert (--ssl-keyfile: vLLM's name)",
        ),
    ),
    (
        SERVER,
        ("--tls-client-ca",),
        dict(
            default=None,
            metavar="PEM",
            help="mutual TLS: refuse clients without a certificate this CA signed",
        ),
    ),
    (
        LOGGING,
        ("--log-level",),
        dict(
            default="info",
            type=str.lower,
            choices=["debug", "info", "warning", "error", "critical"],
            help="level of tokenbudget's own log lines; debug adds one line per finished request. "
            "Other libraries log at info and above (default %(default)s)",
        ),
    ),
    (
        LOGGING,
        ("--log-stats-interval",),
        dict(
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="log a stats line (generation "
            "tokens/s, running and waiting requests, KV cache usage, prefix cache hit rate, "
            "finished requests) this often while requests run, quiet while idle; 0 disables "
            "(default %(default)s)",
        ),
    ),
    (
        WORKERS,
        ("--worker",),
        dict(
            action="append",
            default=[],
            metavar="HOST:PORT",
            help="a remote worker started with "
            "`python -m tokenbudget.worker --port P`; repeatable. Without it the model runs in "
            "this process. Several workers run every step in lockstep and the first one's output "
            "is used (replicas: no added throughput; for a tensor-parallel group on several hosts, "
            "give rank 0's address once). If workers die or hang, requests in flight fail with "
            "UNAVAILABLE and the server reconnects (backoff up to 10 s), then serves again.",
        ),
    ),
    (
        WORKERS,
        ("--worker-secret-file",),
        dict(
            default=None,
            metavar="PATH",
            help="the shared secret of workers started with the same "
            "--worker-secret-file; sent with every call to them",
        ),
    ),
    (
        WORKERS,
        ("--worker-connect-timeout",),
        dict(
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="at start, how long each --worker "
            "has to accept the connection before the server exits with an error (default "
            "%(default)s; loading the model after that has no limit). Reconnecting after a "
            "failure waits up to 10 s an attempt and retries",
        ),
    ),
    (
        WORKERS,
        ("--worker-step-timeout",),
        dict(
            type=float,
            default=300.0,
            metavar="SECONDS",
            help="a worker that leaves a step "
            "unanswered this long is declared hung: health turns NOT_SERVING, requests in flight "
            "fail, and the server reconnects. 0 = never. The default (%(default)s, vLLM's "
            "execute-model timeout) leaves room for a first step's lazy CUDA/kernel set-up and a "
            "full-budget prefill of a large model on CPU; --worker-hang-timeout tightens it "
            "once the worker has answered steps",
        ),
    ),
    (
        WORKERS,
        ("--worker-hang-timeout",),
        dict(
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="once a worker has answered two steps, a step it leaves unanswered for this "
            "long, or 20x the slowest step it answered after its first if that is longer, "
            "declares it hung (never later than --worker-step-timeout), so a hang is found in "
            "seconds rather than minutes. 0 = only --worker-step-timeout (default %(default)s)",
        ),
    ),
    # Our older spelling of --no-enable-prefix-caching.
    (
        KV_CACHE,
        ("--no-prefix-caching",),
        dict(
            dest="enable_prefix_caching", action="store_false", help="as --no-enable-prefix-caching"
        ),
    ),
]
