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
import asyncio
import errno
import logging
import signal
import sys
from importlib import metadata
from typing import NoReturn

from tokenbudget.core.config import POLICIES
from tokenbudget.core.utils.gc_policy import DEFAULT_GEN0_THRESHOLD, configure_gc
from tokenbudget.core.structured.manager import DEFAULT_GRAMMAR_CACHE_BYTES
from tokenbudget.server.engine.args import DEFAULT_MAX_MODEL_LEN, KV_CACHE_DTYPES
from tokenbudget.server.engine.mm_processor import (DEFAULT_MAX_IMAGE_PIXELS,
                                             DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST)

logger = logging.getLogger("tokenbudget.server")

_REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version",
                   version=f"%(prog)s (tokenbudget) {metadata.version('tokenbudget')}")
    g = p.add_argument_group("model")
    g.add_argument("--model", help="Hugging Face checkpoint: a local folder or a hub id. "
                   "Without it the built-in tiny demo model (random weights) is served.")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name GetModelInfo and the gateway report (default: --model)")
    g.add_argument("--tokenizer", default=None, metavar="PATH_OR_ID",
                   help="tokenizer folder or hub id (default: --model)")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a hub model (and of its tokenizer unless "
                   "--tokenizer names another)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run the checkpoint's own modelling code (transformers' "
                   "trust_remote_code)")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16", "float", "half"],
                   help="weights and activations (default %(default)s: float32 on CPU; on a "
                   "GPU the checkpoint's half dtype, else bfloat16)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the global generator that requests without their own seed "
                   "draw from (default %(default)s)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template, a file or the template itself (default: the "
                   "tokenizer's)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_new_tokens) for fields a request leaves unset: "
                   "auto = the model's generation_config.json, vllm = none, or a folder "
                   "holding one (default %(default)s)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / prompt_logprobs a request may ask for; -1 = the "
                   "vocabulary (default %(default)s)")
    g.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config",
                   default=None, metavar="JSON",
                   help='embedding requests\' default pooling, e.g. \'{"pooling_type": "MEAN", '
                   '"normalize": false}\': pooling_type LAST, MEAN or CLS, normalize (L2) true '
                   "or false; a field left out comes from the model (its sentence-transformers "
                   "modules.json, else LAST with normalize for decoders). Requests may override "
                   "both (--override-pooler-config is vLLM's older name)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="accepted for vLLM compatibility and changes nothing: tokenbudget "
                   "never captures CUDA graphs, it always runs eagerly")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if "
                   "available, else cpu)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "flash_attn"],
                   help="paged attention kernel (default %(default)s: the fastest available)")
    g.add_argument("--torch-threads", type=int, default=0,
                   help="torch intra-op threads on CPU; 0 keeps torch's default")
    g.add_argument("--demo-dir", default=None,
                   help="where the demo model is built and cached "
                   "(default $TOKENBUDGET_CACHE/demo or ~/.cache/tokenbudget/demo)")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the gRPC and metrics ports bind (default %(default)s: only "
                   "this machine can connect; --host 0.0.0.0 serves every interface)")
    g.add_argument("--port", type=int, default=50051,
                   help="gRPC port; 0 picks a free one (default %(default)s). A port another "
                   "process listens on is refused")
    g.add_argument("--max-message-size", type=int, default=64 << 20,
                   help="largest request message in bytes; larger ones get RESOURCE_EXHAUSTED "
                   "(default 64 MiB)")
    g.add_argument("--max-concurrent-rpcs", "--grpc-threads", type=int, default=512,
                   help="the most model calls (Generate, ours and the SGLang gateway's, and "
                   "Embed) in flight; more are refused at once with RESOURCE_EXHAUSTED. "
                   "Health checks, GetStats and GetModelInfo are always answered (default "
                   "%(default)s; all streams share one asyncio event loop, --grpc-threads is "
                   "the old name)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics, HOST being "
                   "--host (default: off)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight (default %(default)s)")
    g.add_argument("--record-trace", metavar="PATH", default=None,
                   help="record every finished request's arrival time, prompt and output "
                   "lengths, tenant, SLO targets and prompt block hashes (no text, no token "
                   "ids) and write them to PATH at exit, for `python -m "
                   "tokenbudget.server.sim` to replay")
    g.add_argument("--gil-switch-interval-ms", type=float, default=1.0,
                   help="how long a Python thread may hold the GIL while another waits "
                   "(default %(default)s; CPython's own is 5). The engine thread must send the "
                   "next step while the event loop streams the last step's tokens; waiting up "
                   "to 5 ms for the GIL there leaves a remote worker idle")
    g.add_argument("--gc-threshold", type=int, default=DEFAULT_GEN0_THRESHOLD,
                   help="Python collector's generation-0 threshold, set after start-up when "
                   "the heap is frozen (default %(default)s; CPython's own is 700)")
    g.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="an image with more pixels (width x height, read from its header before "
                   "decoding) is refused with INVALID_ARGUMENT (default %(default)s = 4096x4096; "
                   "decoding costs about 10 bytes a pixel; the model's image processor then "
                   "resizes to its own max_pixels)")
    g.add_argument("--max-image-pixels-per-request", type=int,
                   default=DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST,
                   help="a request whose images add up to more pixels is refused before any is "
                   "decoded (default %(default)s)")
    g.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="a text prompt (after its chat template) longer than this in UTF-8 bytes "
                   "is refused before tokenizing; with truncate_prompt_tokens only its tail is "
                   "tokenized (default: --max-model-len x the tokenizer's longest token in "
                   "bytes, x3 when it normalizes Unicode: a text that can never fit)")
    g.add_argument("--grammar-cache-bytes", type=int, default=DEFAULT_GRAMMAR_CACHE_BYTES,
                   help="compiled structured-output grammars kept for reuse, in bytes; least "
                   "recently used go first (default %(default)s = 512 MiB)")
    g.add_argument("--grammar-compile-timeout-s", type=float, default=30.0,
                   help="a structured-output grammar not compiled in this time fails its "
                   "request with DEADLINE_EXCEEDED (default %(default)s)")
    g.add_argument("--api-key", default=None,
                   help="require metadata 'authorization: Bearer API_KEY' on every call "
                   "(UNAUTHENTICATED otherwise); grpc.health.v1 stays open for probes. Send "
                   "it over TLS, or on loopback only")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve TLS with this certificate (chain) and --tls-key")
    g.add_argument("--tls-key", default=None, metavar="PEM",
                   help="the private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="mutual TLS: refuse clients without a certificate this CA signed")

    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default="info", type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="level of tokenbudget's own log lines; debug adds one line per "
                   "finished request. Other libraries log at info and above "
                   "(default %(default)s)")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="log a stats line (generation tokens/s, running and waiting requests, "
                   "KV cache usage, prefix cache hit rate, finished requests) this often "
                   "while requests run, quiet while idle; 0 disables (default %(default)s)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (as --log-stats-interval 0)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per finished request at info level (without it: at "
                   "debug level)")

    g = p.add_argument_group("workers")
    g.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a remote worker started with `python -m tokenbudget.worker --port P`; "
                   "repeatable. Without it the model runs in this process. Several "
                   "workers run every step in lockstep and the first one's output is used "
                   "(replicas: no added throughput; for a tensor-parallel group on several "
                   "hosts, give rank 0's address once). If workers die or hang, requests in "
                   "flight fail with UNAVAILABLE and the server reconnects (backoff up to "
                   "10 s), then serves again.")
    g.add_argument("--worker-secret-file", default=None, metavar="PATH",
                   help="the shared secret of workers started with the same "
                   "--worker-secret-file; sent with every call to them")
    g.add_argument("--worker-connect-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="at start, how long each --worker has to accept the connection "
                   "before the server exits with an error (default %(default)s; loading "
                   "the model after that has no limit). Reconnecting after a failure "
                   "waits up to 10 s an attempt and retries")
    g.add_argument("--worker-step-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a worker that leaves a step unanswered this long is declared hung: "
                   "health turns NOT_SERVING, requests in flight fail, and the server "
                   "reconnects. 0 = never. The default (%(default)s, vLLM's execute-model "
                   "timeout) leaves room for a first step's lazy CUDA/kernel set-up and a "
                   "full-budget prefill of a large model on CPU")

    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N worker processes started on this host "
                   "(torch.distributed: gloo on CPU, NCCL on CUDA; default %(default)s). For "
                   "several hosts, start `python -m tokenbudget.worker --rank R --world-size N "
                   "--dist-init tcp://HOST:PORT` on each and give rank 0's address to --worker")

    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one step, prefill chunks and decodes together "
                   "(default %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests running at once (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output limit per request; a request's max_tokens beyond what "
                   "its prompt leaves is clamped to it (default: the model's, at most "
                   f"{DEFAULT_MAX_MODEL_LEN}, or its sliding window)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap one request's prefill chunk per step; 0 = no cap (default)")
    g.add_argument("--policy", "--scheduling-policy", default="fcfs", choices=POLICIES,
                   help="waiting-queue order (default %(default)s; --scheduling-policy is "
                   "vLLM's name, which has fcfs and priority; slo orders by the requests' "
                   "TTFT deadlines)")
    g.add_argument("--async-scheduling", dest="async_scheduling", action="store_true",
                   default=True, help="schedule step N+1 while step N runs (the default, for "
                   "server and LLM alike: the same tokens, and the worker never waits for the "
                   "scheduler; with --speculative-config, steps verifying drafts run alone)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="schedule step N+1 only after step N returned")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="prompts longer than a step's budget are split into "
                   "chunks: always on (--no-enable-chunked-prefill is refused)")
    g.add_argument("--max-num-partial-prefills", type=int, default=1,
                   help="prompts partially prefilled at once: 1, what the scheduler does "
                   "(other values are refused)")
    g.add_argument("--encoder-compute-budget", type=int, default=8192,
                   help="vision encoder embeddings computed per step (default %(default)s)")
    g.add_argument("--encoder-cache-size", type=int, default=8192,
                   help="vision encoder embeddings kept for requests that still need them "
                   "(default %(default)s)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, as in vLLM: a JSON object such as "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                   "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' (n-gram prompt "
                   "lookup, the one method here; drafts are verified so outputs keep the "
                   "model's distribution). Default: off")

    g = p.add_argument_group("scheduling policy (SGLang-style)")
    g.add_argument("--max-queued-requests", type=int, default=0,
                   help="waiting requests beyond this are refused with RESOURCE_EXHAUSTED; with "
                   "--policy priority the worst queued one is evicted for a strictly better "
                   "newcomer (default 0: unlimited)")
    g.add_argument("--priority-descending", action="store_true",
                   help="--policy priority: higher values run first (default: lower first)")
    g.add_argument("--priority-preemption-threshold", type=int, default=10,
                   help="--policy priority: a waiting request may preempt running ones whose "
                   "priority is worse by more than this; negative disables (default %(default)s)")
    g.add_argument("--preemption-mode", choices=["vllm", "retract"], default="vllm",
                   help="victim on memory shortage: vllm (last admitted / worst priority) or "
                   "retract (fewest generated tokens, then longest prompt) (default %(default)s)")
    g.add_argument("--admission-reserve", dest="admission_reserve", action="store_true",
                   default=None, help="reserve KV for running requests' expected output when "
                   "admitting (default: on for lpm/dfs-weight/lof/random, off for fcfs/priority)")
    g.add_argument("--no-admission-reserve", dest="admission_reserve", action="store_false",
                   help="admit on the KV blocks free now, reserving none for running "
                   "requests' expected output (the default for fcfs/priority)")
    g.add_argument("--init-new-token-ratio", type=float, default=0.7,
                   help="admission reserve: the fraction of running requests' remaining "
                   "max_tokens reserved at first (default %(default)s)")
    g.add_argument("--min-new-token-ratio", type=float, default=0.1,
                   help="admission reserve: the floor the ratio decays to (default %(default)s)")
    g.add_argument("--new-token-ratio-decay", type=float, default=0.001,
                   help="admission reserve: decay of the ratio per step without preemption "
                   "(default %(default)s)")
    g.add_argument("--reserve-clip-tokens", type=int, default=4096,
                   help="admission reserve: at most this many tokens reserved per running "
                   "request (default %(default)s)")
    g.add_argument("--aging-bound-s", type=float, default=30.0,
                   help="lpm/dfs-weight: requests waiting longer than this go first, in arrival "
                   "order; 0 disables (default %(default)s)")
    g.add_argument("--lpm-fallback-queue-len", type=int, default=128,
                   help="lpm orders by cached prefix only while at most this many wait "
                   "(default %(default)s)")
    g.add_argument("--cache-aware-window", type=int, default=128,
                   help="dfs-weight orders this many requests at the head of the queue "
                   "(default %(default)s)")
    g.add_argument("--in-batch-prefix-check-threshold", type=int, default=32,
                   help="in-batch prefix deprioritisation applies to requests with at most this "
                   "many cached tokens; 0 disables (default %(default)s)")
    g.add_argument("--in-batch-prefix-deprioritize-threshold", type=int, default=32,
                   help="...and sharing at least this many tokens with one chosen earlier in "
                   "the round (default %(default)s)")
    g.add_argument("--random-seed", type=int, default=0, help="seed of --policy random")
    g.add_argument("--slo-reject-late", action="store_true",
                   help="--policy slo: refuse (finish \"abort\") a waiting request that cannot "
                   "get its first token by its ttft_ms deadline, instead of letting it wait "
                   "behind the ones that can")
    g.add_argument("--slo-step-time-ms", type=float, default=0.0,
                   help="--policy slo: step time for the deadline estimates; 0 learns it from "
                   "the steps (default)")
    g.add_argument("--fair-share", action="store_true",
                   help="share the token budget between tenants (GenerateRequest.tenant) by "
                   "weight, so one tenant's flood cannot starve another (not with "
                   "--policy priority)")
    g.add_argument("--tenant-weights", type=_tenant_weights, default=None, metavar="JSON",
                   help='--fair-share weights, e.g. \'{"gold": 4, "free": 1}\' (a tenant not '
                   "listed weighs 1)")
    g.add_argument("--fair-share-chunk-cap", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="--fair-share: while other tenants have work, cap a tenant's prompt "
                   "tokens per step at its weighted share of --max-num-batched-tokens, so its "
                   "long prefills do not slow the others' decodes (default on)")

    g = p.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block "
                   "(default %(default)s)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks across requests with the same prefix (default on)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="as --no-enable-prefix-caching")
    g.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks",
                   type=int, default=None,
                   help="KV blocks to allocate (overrides memory-based sizing)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto (default): the model's dtype, the only one the cache is kept "
                   "in; naming that dtype is accepted, others and fp8 are refused")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory",
                   default=None,
                   help="KV cache size, e.g. 2GiB or 512MB (default on CPU: 1GiB, or less when "
                   "--max-num-seqs sequences at --max-model-len need less; on a GPU: what "
                   "--gpu-memory-utilization leaves free after a profile run)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + activations + KV "
                   "(default %(default)s)")
    g.add_argument("--hash-algo", choices=["sha256", "xxhash"], default="sha256",
                   help="prefix-cache block hash: sha256 (default, collision resistant) or "
                   "xxhash (faster, not collision resistant, so seeded: see --hash-seed; "
                   "pip install 'tokenbudget[fast-hash]')")
    g.add_argument("--hash-seed", type=int, default=None,
                   help="seed of the xxhash block hash (default: random per process, so "
                   "clients cannot precompute colliding prompts; set it for hashes that agree "
                   "across processes and restarts); sha256 ignores it")
    g.add_argument("--kv-offload-memory", default=None,
                   help="host-memory KV tier, e.g. 8GiB (pinned on a GPU machine): preempted "
                   "requests swap their KV there instead of recomputing it, and prefix blocks "
                   "evicted from the device cache spill there (default: off)")
    g.add_argument("--num-offload-blocks", type=int, default=None,
                   help="host KV tier size in blocks (overrides --kv-offload-memory)")
    g.add_argument("--kv-load-blocks-per-step", type=int, default=256,
                   help="at most this many blocks copied from the host tier to the device per "
                   "step (default %(default)s; one request needing more loads alone)")
    g.add_argument("--enable-kv-cache-events", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="publish KV cache events (block stored/removed per tier, all cleared) "
                   "on the SubscribeKvEvents stream (default off)")
    return p


def _tenant_weights(text: str) -> dict[str, float]:
    """--tenant-weights: a JSON object of tenant -> weight."""
    import json

    try:
        weights = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(weights, dict) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights.values()):
        raise argparse.ArgumentTypeError('expected a JSON object of numbers, e.g. {"a": 2}')
    return {str(k): float(w) for k, w in weights.items()}


def engine_args_from(args: argparse.Namespace):
    """The EngineArgs of the parsed flags; refuses (UnsupportedArgument, a
    ValueError) what cannot be honoured, before anything loads."""
    from tokenbudget.server.engine.args import EngineArgs, UnsupportedArgument

    engine_args = EngineArgs.from_cli_args(args)
    check_server_flags(args)
    if args.worker and args.tensor_parallel_size > 1:
        raise UnsupportedArgument(
            "--tensor-parallel-size with --worker", "ranks on other hosts are started with "
            "`python -m tokenbudget.worker --rank R --world-size N --dist-init URL`; give "
            "rank 0's address to --worker and leave --tensor-parallel-size at 1")
    if args.worker:
        # Initialize carries the model path, dtype, device and attention backend only.
        for flag, given in (("--revision", args.revision is not None),
                            ("--trust-remote-code", args.trust_remote_code),
                            ("--kv-cache-dtype", args.kv_cache_dtype != "auto")):
            if given:
                raise UnsupportedArgument(f"{flag} with --worker", "a remote worker is told "
                                          "only the model path, dtype, device and attention "
                                          "backend; give --model a local folder it can read")
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
    if not args.worker_connect_timeout > 0:
        raise ValueError("--worker-connect-timeout must be > 0, got "
                         f"{args.worker_connect_timeout}")
    if args.worker_secret_file is not None:
        if not args.worker:
            raise ValueError("--worker-secret-file needs --worker: it authenticates the "
                             "server to remote workers")
        read_secret_file(args.worker_secret_file)
    if args.max_concurrent_rpcs < 1:
        raise ValueError(f"--max-concurrent-rpcs must be >= 1, got {args.max_concurrent_rpcs}")


def build_engine(args: argparse.Namespace, metrics=None):
    """An AsyncEngine for the parsed arguments (loads the model, sizes the KV cache)."""
    from tokenbudget.server.engine.core import EngineCore
    from tokenbudget.server.engine.async_engine import AsyncEngine
    from tokenbudget.server.entrypoints.demo import ensure_demo_model
    from tokenbudget.server.engine.generation_defaults import load_generation_defaults
    from tokenbudget.server.engine.input_processor import InputProcessor
    from tokenbudget.server.engine.pooler_defaults import load_pooler_config
    from tokenbudget.worker.grpc_worker import check_port_free
    from tokenbudget.worker.loader import check_supported
    from tokenbudget.core.utils.model_source import load_config

    engine_args = engine_args_from(args)
    is_demo = args.model is None
    model = args.model or ensure_demo_model(args.demo_dir)
    if is_demo:
        logger.warning("no --model given: serving the built-in DEMO model from %s "
                       "(tiny Qwen3 with RANDOM weights; its text is gibberish)", model)
    engine_args.model = model
    config = load_config(model, revision=args.revision, trust_remote_code=args.trust_remote_code)
    check_supported(config, model)
    text_config = config.get_text_config()
    max_model_len = engine_args.resolve_max_model_len(text_config)
    scheduler_config = engine_args.scheduler_config(max_model_len)
    cache_config = engine_args.cache_config()
    input_processor = InputProcessor.from_pretrained(
        model, vocab_size=text_config.vocab_size, trust_remote_code=args.trust_remote_code,
        tokenizer=args.tokenizer, revision=args.revision,
        chat_template=engine_args.read_chat_template(),
        max_logprobs=engine_args.max_logprobs_for(text_config.vocab_size),
        **engine_args.input_limits(max_model_len))
    defaults = load_generation_defaults(model, source=args.generation_config,
                                        revision=args.revision,
                                        tokenizer_eos_token_id=input_processor.eos_token_id)
    # Loading the weights takes seconds to minutes: a taken port fails first.
    check_port_free(args.host, args.port)
    executor = _make_executor(args, model, engine_args.async_scheduling)
    core = EngineCore(scheduler_config, cache_config, executor,
                      engine_args.structured_output_manager(input_processor.tokenizer,
                                                            text_config.vocab_size),
                      max_model_len_given=engine_args.max_model_len is not None)
    logger.info("KV cache: %d blocks of %d tokens; async scheduling %s", cache_config.num_blocks,
                cache_config.block_size, "on" if engine_args.async_scheduling else "off")
    return AsyncEngine(core, input_processor, metrics, model_name=model,
                       served_model_name=args.served_model_name,
                       sampling_defaults=defaults.sampling, eos_token_ids=defaults.eos_token_ids,
                       is_vision_language=getattr(config, "vision_config", None) is not None,
                       is_demo=is_demo, num_remote_workers=len(args.worker),
                       trace_recorder=_trace_recorder(args, cache_config.block_size),
                       pooler_config=load_pooler_config(model, engine_args.pooler_config,
                                                        revision=args.revision))


def _trace_recorder(args: argparse.Namespace, block_size: int):
    if not args.record_trace:
        return None
    from tokenbudget.server.sim.traces import TraceRecorder

    return TraceRecorder(block_size)


def _make_executor(args: argparse.Namespace, model: str, async_scheduling: bool):
    if args.worker:
        from tokenbudget.proto.rpc.auth import read_secret_file
        from tokenbudget.server.executor.remote import RemoteExecutor

        logger.info("driving remote workers %s", ", ".join(args.worker))
        secret = getattr(args, "worker_secret_file", None)
        return RemoteExecutor(args.worker, model, dtype=args.dtype, device=args.device or "",
                              attention_backend=args.attention_backend,
                              max_message_size=max(args.max_message_size, 256 << 20),
                              connect_timeout=args.worker_connect_timeout,
                              step_timeout=getattr(args, "worker_step_timeout", 0.0),
                              secret=read_secret_file(secret) if secret else None)
    if args.tensor_parallel_size > 1:
        from tokenbudget.server.executor.tensor_parallel import TensorParallelExecutor

        logger.info("starting %d tensor-parallel ranks", args.tensor_parallel_size)
        return TensorParallelExecutor(model, args.tensor_parallel_size, dtype=args.dtype,
                                      device=args.device or "",
                                      attention_backend=args.attention_backend,
                                      threads=args.torch_threads or None,
                                      step_timeout=getattr(args, "worker_step_timeout", 0.0))
    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker

    worker = Worker(model, dtype=args.dtype, device=args.device,
                    attention_backend=args.attention_backend,
                    trust_remote_code=args.trust_remote_code, revision=args.revision,
                    kv_cache_dtype=args.kv_cache_dtype, seed=args.seed)
    return InProcessExecutor(worker, async_mode=async_scheduling)


def serve(args: argparse.Namespace, engine) -> int:
    """Run the gRPC server until SIGTERM/SIGINT; returns the exit status.
    Raises BindError (the engine shut down) when the port cannot be bound."""
    return asyncio.run(_serve(args, engine))


async def _serve(args: argparse.Namespace, engine) -> int:
    # grpc.aio: every stream is a coroutine on this thread's event loop, which
    # costs about half the CPU per streamed token of a thread per stream.
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tokenbudget.server.entrypoints.grpc import sglang as sglang_service
    from tokenbudget.server.entrypoints.grpc.generation import SERVICE_NAME, add_generation_servicer
    from tokenbudget.server.entrypoints.grpc.limits import GenerationLimitInterceptor
    from tokenbudget.server.entrypoints.grpc.security import ApiKeyInterceptor, server_credentials
    from tokenbudget.worker.grpc_worker import NO_PORT_REUSE, bind_port

    # The key is checked first: a call without it must not take a generation slot.
    interceptors = [ApiKeyInterceptor(args.api_key)] if args.api_key else []
    interceptors.append(GenerationLimitInterceptor(args.max_concurrent_rpcs, (
        f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/Embed",
        f"/{sglang_service.SERVICE_NAME}/Generate")))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", args.max_message_size),
                 ("grpc.max_send_message_length", args.max_message_size), NO_PORT_REUSE])
    try:
        port = bind_port(server, args.host, args.port,
                         server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca))
    except OSError:
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        raise
    servicer = add_generation_servicer(server, engine)
    # The SGLang model gateway's worker protocol, on the same port.
    sglang = sglang_service.add_sglang_scheduler_servicer(
        server, engine, served_model_name=getattr(args, "served_model_name", None))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # The worker's control plane (Initialize, Shutdown) is not served here and
    # must not be advertised on the public port.
    _enable_reflection(server, (SERVICE_NAME, sglang_service.SERVICE_NAME,
                                health.SERVICE_NAME))

    health_lock = asyncio.Lock()  # a death and a recovery in quick succession apply in order

    async def set_health(status) -> None:
        async with health_lock:
            for name in ("", SERVICE_NAME, sglang_service.SERVICE_NAME):
                await health_servicer.set(name, status)

    loop = asyncio.get_running_loop()

    def on_death(exc: BaseException) -> None:  # called on the engine thread
        try:
            asyncio.run_coroutine_threadsafe(
                set_health(health_pb2.HealthCheckResponse.NOT_SERVING), loop)
        except RuntimeError:  # the loop is closed: the server is gone anyway
            pass

    def on_recovery() -> None:  # called on the engine thread
        if servicer.draining.is_set():
            return
        try:
            asyncio.run_coroutine_threadsafe(
                set_health(health_pb2.HealthCheckResponse.SERVING), loop)
        except RuntimeError:
            pass

    engine.on_death(on_death)
    engine.on_recovery(on_recovery)
    await server.start()
    await set_health(health_pb2.HealthCheckResponse.SERVING if engine.healthy
                     else health_pb2.HealthCheckResponse.NOT_SERVING)
    sglang.ready = True
    # Tests and scripts wait for this line (the port may have been picked by the OS).
    print(f"tokenbudget server listening on {args.host}:{port}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("draining: refusing new requests, waiting up to %.0fs for %d in flight",
                args.drain_timeout, engine.num_requests)
    servicer.draining.set()
    sglang.draining = True
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    # Blocking waits run off the loop, which keeps streaming the requests in flight.
    if not await loop.run_in_executor(None, engine.wait_idle, args.drain_timeout):
        logger.warning("drain timeout: aborting %d requests", engine.num_requests)
    # What the drain left, for operators (and tests): all zeros unless it timed out.
    try:
        s = await loop.run_in_executor(None, engine.get_stats, 2.0)
        logger.info("drained: %d requests running, %d waiting, %d of %d KV blocks in use",
                    s.num_running, s.num_waiting, s.num_total_blocks - s.num_free_blocks,
                    s.num_total_blocks)
    except Exception as exc:  # an engine that died or hangs has no stats to give
        logger.warning("drained; the engine gave no stats: %s", exc)
    await loop.run_in_executor(None, engine.shutdown)
    await server.stop(grace=2)
    if engine.trace_recorder is not None:
        engine.trace_recorder.save(args.record_trace)
        logger.info("trace of %d requests written to %s",
                    len(engine.trace_recorder.requests), args.record_trace)
    logger.info("stopped")
    return 0


def _enable_reflection(server, service_names: tuple[str, ...]) -> None:
    """Server reflection (on a grpc.aio server) under both names clients ask
    for: grpc.reflection.v1 (grpcurl, current gRPC libraries) and v1alpha
    (older ones). grpcio-reflection implements only v1alpha; v1's messages are
    the same on the wire (same fields and numbers, another package), so one
    servicer answers under both names."""
    import grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    names = (reflection.SERVICE_NAME, _REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer((*service_names, *names))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
        for name in names))


def configure_logging(args: argparse.Namespace) -> None:
    """--log-level for tokenbudget's loggers; other libraries log at info and above."""
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=max(level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokenbudget").setLevel(level)


def make_metrics(args: argparse.Namespace):
    """The engine's observer: Prometheus metrics and the stats / request log lines."""
    from tokenbudget.server.engine.metrics import EngineMetrics

    return EngineMetrics(args.served_model_name or args.model or "demo",
                         log_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
                         log_requests=args.enable_log_requests)


def _refuse(message: object) -> NoReturn:
    """A configuration error: one line on stderr, exit status 2 (as argparse's)."""
    print(f"server: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        engine_args_from(args)
    except ValueError as exc:
        _refuse(exc)
    configure_logging(args)
    if args.gc_threshold < 1:
        sys.exit(f"server: --gc-threshold must be >= 1, got {args.gc_threshold}")
    if args.gil_switch_interval_ms <= 0:
        sys.exit("server: --gil-switch-interval-ms must be > 0, got "
                 f"{args.gil_switch_interval_ms}")
    if args.log_stats_interval < 0:
        sys.exit(f"server: --log-stats-interval must be >= 0, got {args.log_stats_interval}")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    from tokenbudget.worker.grpc_worker import BindError

    metrics = make_metrics(args)
    try:
        if args.metrics_port is not None:
            try:
                metrics.serve(args.metrics_port, args.host)
            except OSError as exc:
                reason = ("address already in use" if exc.errno == errno.EADDRINUSE
                          else exc.strerror)
                sys.exit(f"server: cannot serve metrics on {args.host}:{args.metrics_port}: "
                         f"{reason}")
            logger.info("Prometheus metrics on http://%s:%d/metrics", args.host,
                        args.metrics_port)
        sys.setswitchinterval(args.gil_switch_interval_ms / 1000)
        try:
            engine = build_engine(args, metrics)
        except ValueError as exc:  # a bad setting or a checkpoint that cannot be read
            _refuse(exc)
        except ConnectionError as exc:  # a --worker that cannot be reached or refuses us
            sys.exit(f"server: {exc}")
        # Start-up is done: freeze what it built and keep collections out of the steps.
        policy = configure_gc(args.gc_threshold)
        logger.info("gc: froze %d start-up objects; thresholds %s", policy.frozen,
                    policy.thresholds)
        sys.exit(serve(args, engine))
    except BindError as exc:  # the port is taken: say so, without a traceback
        sys.exit(f"server: {exc}")
    finally:
        metrics.close()


if __name__ == "__main__":
    main()
