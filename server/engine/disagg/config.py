"""The disaggregated prefill/decode settings, with SGLang's flag names (we
sit behind its gateway) and vLLM's ``--kv-transfer-config`` as another way
to say the same thing.

One engine is a prefill (computes prompts, sends their KV to the decode that
registers for them on its bootstrap port) or a decode (receives the KV, then
decodes); "null" is neither. ``check_disaggregation`` refuses combinations
that say two different things, in one line naming the flags."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from tokenbudget.core.config import setting
from tokenbudget.core.kv.connector import DECODE, PREFILL

DISAGGREGATION = "disaggregation (prefill/decode)"
MODES = ("null", PREFILL, DECODE)
TRANSFER_BACKENDS = ("nixl", "mooncake")
# vLLM's kv_role -> our mode; kv_both (one engine doing both) is not a split.
KV_ROLES = {"kv_producer": PREFILL, "kv_consumer": DECODE}
# vLLM's kv_connector -> our transfer backend.
KV_CONNECTORS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}
# The other keys of vLLM's KVTransferConfig: accepted (a vLLM command line
# keeps working) and ignored; any other key is refused as a likely typo.
VLLM_KV_TRANSFER_KEYS = frozenset(
    (
        "engine_id",
        "kv_buffer_device",
        "kv_buffer_size",
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_port",
        "kv_connector_extra_config",
        "kv_connector_module_path",
        "kv_load_failure_policy",
        "enable_permute_local_kv",
    )
)


def parse_kv_transfer_config(text: str | dict[str, Any]) -> dict[str, Any]:
    """--kv-transfer-config: vLLM's JSON object, e.g.
    ``{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`` (a dict is
    checked the same way); ValueError naming the field that is wrong."""
    if isinstance(text, str):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_transfer_config is not JSON: {exc}") from None
    else:
        config = text
    if not isinstance(config, dict):
        raise ValueError(
            'kv_transfer_config must be a JSON object, e.g. {"kv_connector": '
            '"NixlConnector", "kv_role": "kv_producer"}'
        )
    unknown = sorted(set(config) - {"kv_connector", "kv_role"} - VLLM_KV_TRANSFER_KEYS)
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key {unknown[0]!r}")
    connector = config.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise ValueError(
            f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
            f"got {connector!r}"
        )
    role = config.get("kv_role")
    if role == "kv_both":
        raise ValueError(
            "kv_transfer_config.kv_role 'kv_both' is not supported: an engine is either "
            "the prefill (kv_producer) or the decode (kv_consumer) of a pair"
        )
    if role not in KV_ROLES:
        raise ValueError(
            f"kv_transfer_config.kv_role must be kv_producer or kv_consumer, got {role!r}"
        )
    return dict(config)


@dataclass(slots=True)
class DisaggregationConfig:
    """Whether this engine is one half of a prefill/decode pair, and how the
    halves meet (the bootstrap port) and move KV (the transfer backend)."""

    disaggregation_mode: str = setting(
        "null",
        "this server's part in disaggregated prefill/decode behind the SGLang gateway's "
        "--pd-disaggregation: prefill (compute prompts, send their KV to the decode), "
        "decode (receive the KV, then decode) or null (both, as usual; default)",
        group=DISAGGREGATION,
        choices=MODES,
    )
    disaggregation_bootstrap_port: int = setting(
        8998,
        "port of a prefill server's bootstrap listener, on --host, where decode servers "
        "register for the KV of their requests; authenticated with --worker-secret-file "
        "when one is given (default %(default)s, the gateway's default)",
        group=DISAGGREGATION,
    )
    disaggregation_transfer_backend: str = setting(
        "nixl",
        "library that moves KV blocks between the servers (default %(default)s)",
        group=DISAGGREGATION,
        choices=TRANSFER_BACKENDS,
    )
    disaggregation_timeout: float = setting(
        30.0,
        "seconds a decode waits for a request's KV to arrive, and a prefill holds a "
        "finished request's KV for its decode to register (default %(default)s)",
        group=DISAGGREGATION,
    )
    kv_transfer_config: dict[str, Any] | None = setting(
        None,
        "vLLM's way to say the same: a JSON object "
        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"} (prefill) or '
        '"kv_consumer" (decode)',
        group=DISAGGREGATION,
        metavar="JSON",
        parse=parse_kv_transfer_config,
    )

    def __post_init__(self) -> None:
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config)
        check_disaggregation(self)

    @classmethod
    def of(cls, settings: Any) -> DisaggregationConfig:
        """The config of an object that has these fields (EngineArgs), checked."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def mode(self) -> str:
        """prefill, decode or null, from --disaggregation-mode or else
        --kv-transfer-config's kv_role."""
        if self.disaggregation_mode == "null" and self.kv_transfer_config is not None:
            return KV_ROLES[self.kv_transfer_config["kv_role"]]
        return self.disaggregation_mode

    @property
    def transfer_backend(self) -> str:
        """nixl or mooncake: --kv-transfer-config's kv_connector when given
        (check_disaggregation refused a disagreeing non-default flag)."""
        if self.kv_transfer_config is not None:
            return KV_CONNECTORS[self.kv_transfer_config["kv_connector"]]
        return self.disaggregation_transfer_backend

    @property
    def enabled(self) -> bool:
        return self.mode != "null"


def check_disaggregation(config: DisaggregationConfig | Any) -> None:
    """Refuse, in one line naming the flags, values out of range and
    combinations that say two different things. ``config``: a
    DisaggregationConfig or anything with its fields (EngineArgs)."""
    if config.disaggregation_mode not in MODES:
        raise ValueError(
            f"--disaggregation-mode must be one of {', '.join(MODES)}, "
            f"got {config.disaggregation_mode!r}"
        )
    if config.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        raise ValueError(
            "--disaggregation-transfer-backend must be nixl or mooncake, "
            f"got {config.disaggregation_transfer_backend!r}"
        )
    port = config.disaggregation_bootstrap_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--disaggregation-bootstrap-port must be in 1..65535, got {port!r}")
    timeout = config.disaggregation_timeout
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"--disaggregation-timeout must be > 0 seconds, got {timeout!r}")
    if config.kv_transfer_config is None:
        return
    kv = parse_kv_transfer_config(config.kv_transfer_config)
    role = KV_ROLES[kv["kv_role"]]
    if config.disaggregation_mode not in ("null", role):
        raise ValueError(
            f"--kv-transfer-config kv_role {kv['kv_role']!r} ({role}) disagrees with "
            f"--disaggregation-mode {config.disaggregation_mode}"
        )
    backend = KV_CONNECTORS[kv["kv_connector"]]
    if config.disaggregation_transfer_backend not in ("nixl", backend):
        # nixl is the flag's default, so only another value is a second opinion.
        raise ValueError(
            f"--kv-transfer-config kv_connector {kv['kv_connector']!r} disagrees with "
            f"--disaggregation-transfer-backend {config.disaggregation_transfer_backend}"
        )
