"""``vllm serve`` flags that name no engine setting of ours.

Users bring their vLLM command lines. A flag here either means something
we do (``--swap-space`` is the host KV tier, ``--kv-events-config`` turns
on KV cache events; ``--ssl-keyfile``/``--ssl-certfile`` are option strings
of our TLS flags) or is accepted only at the value that asks for what we do
anyway (``--pipeline-parallel-size 1``), and refused otherwise in one line
that says why and what to use instead. Engine settings with vLLM's names
are derived from their fields (server/engine/args.py); this table holds
only the server's own spellings.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable

from tokenbudget.server.engine.args import UnsupportedArgument

GROUP = "vLLM flags (accepted where they ask for what this server does; else refused)"
_GATEWAY = (
    "OpenAI HTTP, tool calls and reasoning are the SGLang gateway's: start "
    "sglang-router with its --tool-call-parser / --reasoning-parser in front of this "
    "server"
)


@dataclass(frozen=True, slots=True)
class VllmFlag:
    names: tuple[str, ...]
    kwargs: dict[str, Any]
    # The values this server honours as they are (they ask for what it does).
    accepts: Callable[[Any], bool]
    why: str

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


def _never(value: Any) -> bool:
    return False


FLAGS = (
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        dict(type=int, metavar="N"),
        lambda n: n == 1,
        "pipeline parallelism is not implemented; shard the model with --tensor-parallel-size",
    ),
    VllmFlag(
        ("--data-parallel-size", "-dp"),
        dict(type=int, metavar="N"),
        lambda n: n == 1,
        "data parallelism is N `server` processes behind the SGLang gateway (README, "
        "Behind the gateway): start one server per replica",
    ),
    VllmFlag(
        ("--quantization", "-q"),
        dict(metavar="METHOD"),
        lambda q: q in ("None", "none"),
        "quantized weights are not supported: serve an unquantized checkpoint, in --dtype",
    ),
    VllmFlag(
        ("--load-format",),
        dict(metavar="FORMAT"),
        lambda f: f in ("auto", "safetensors", "pt"),
        "checkpoints load with transformers (safetensors or pt files): use auto",
    ),
    VllmFlag(
        ("--cpu-offload-gb",),
        dict(type=float, metavar="GIB"),
        lambda g: g == 0,
        "weights stay on the device; --kv-offload-memory keeps KV in host memory instead",
    ),
    VllmFlag(
        ("--distributed-executor-backend",),
        dict(metavar="BACKEND"),
        lambda b: b in ("mp", "uni"),
        "tensor-parallel ranks are processes this server starts (mp) or `python -m "
        "tokenbudget.worker` ranks on other hosts; Ray is not used",
    ),
    VllmFlag(
        ("--enable-expert-parallel",),
        dict(action="store_true", default=None),
        lambda on: not on,
        "expert parallelism is not implemented; use --tensor-parallel-size",
    ),
    VllmFlag(
        ("--hf-overrides",),
        dict(metavar="JSON"),
        lambda text: text.strip() in ("", "{}"),
        "the model's config is read as the checkpoint has it; edit a copy of its "
        "config.json instead",
    ),
    VllmFlag(
        ("--compilation-config",),
        dict(metavar="JSON"),
        _never,
        "the model runs eagerly (no torch.compile or CUDA graphs to configure); drop it",
    ),
    VllmFlag(
        ("--uvicorn-log-level",),
        dict(metavar="LEVEL"),
        _never,
        "this server speaks gRPC, not HTTP: use --log-level (the gateway in front has "
        "its own --log-level)",
    ),
    VllmFlag(
        ("--enable-auto-tool-choice",),
        dict(action="store_true", default=None),
        lambda on: not on,
        _GATEWAY,
    ),
    VllmFlag(("--tool-call-parser",), dict(metavar="NAME"), _never, _GATEWAY),
    VllmFlag(("--reasoning-parser",), dict(metavar="NAME"), _never, _GATEWAY),
)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(GROUP)
    for flag in FLAGS:
        group.add_argument(
            *flag.names,
            dest=flag.dest,
            help=f"refused unless it asks for what this server does: {flag.why}",
            **{"default": None, **flag.kwargs},
        )
    group.add_argument(
        "--swap-space",
        type=float,
        metavar="GIB",
        default=None,
        help="vLLM's CPU swap space: the host KV tier of this many GiB (as --kv-offload-memory)",
    )
    group.add_argument(
        "--kv-events-config",
        metavar="JSON",
        default=None,
        help='vLLM\'s KV events config: {"enable_kv_cache_events": true} turns '
        "them on (as --enable-kv-cache-events; they stream over gRPC "
        "SubscribeKvEvents on this server's port, not ZMQ)",
    )


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse (UnsupportedArgument) what cannot be honoured; map the rest
    onto our settings in ``args``."""
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if value is not None and not flag.accepts(value):
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            name = flag.names[0] if value is True else f"{flag.names[0]} {shown}"
            raise UnsupportedArgument(name, flag.why)
    if args.swap_space is not None:
        if args.kv_offload_memory is not None:
            raise ValueError("--swap-space and --kv-offload-memory name the same setting; give one")
        if args.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {args.swap_space}")
        if args.swap_space:
            args.kv_offload_memory = int(args.swap_space * (1 << 30))
    if args.kv_events_config is not None:
        args.enable_kv_cache_events |= _kv_events_enabled(args.kv_events_config)


def _kv_events_enabled(text: str) -> bool:
    """vLLM's KVEventsConfig JSON: whether it turns events on. Its ZMQ
    publisher settings mean nothing here: events stream over gRPC."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--kv-events-config must be a JSON object, got {text!r}")
    publisher = config.get("publisher", "zmq" if config.get("enable_kv_cache_events") else None)
    if publisher not in (None, "null", "zmq"):
        raise UnsupportedArgument(
            f"--kv-events-config publisher {publisher!r}",
            "KV events stream over gRPC (SubscribeKvEvents)",
        )
    return bool(config.get("enable_kv_cache_events", False))
