"""LoRA adapters as the scheduler and the engine front see them (no torch).

``LoRARequest(name, int_id, path)`` names one PEFT adapter folder
(adapter_config.json + adapter_model.safetensors); ``int_id`` is the
adapter's identity everywhere: in block hashes (core/kv/hashing.py), in the
scheduler's per-step adapter limit (core/sched/lora_gate.py) and in the
worker's device slots (worker/lora.py). ``LoRAConfig`` holds the settings
behind ``--enable-lora`` and friends (vLLM's names); ``check_adapter_config``
refuses, before a request is queued, what the adapter_config.json alone shows
cannot be served.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from tokenbudget.core.config import setting

LORA = "LoRA adapters"
# Linear layers an adapter may target (the attention and MLP projections of
# Llama/Qwen-style decoders).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# adapter_config.json keys whose non-default values we cannot serve.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "layer_replication": "layer_replication is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
    "trainable_token_indices": "trainable_token_indices (embedding deltas) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
}


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One adapter, as vLLM's: a name, a positive integer id unique per
    adapter, and the folder of its PEFT files."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an int")
        if self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_int_id must be >= 1, got {self.lora_int_id}"
            )

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def int_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(entry, dict) or not {"name", "path"} <= entry.keys():
            raise ValueError('expected {"name": ..., "path": ...}')
        return str(entry["name"]), str(entry["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected name=path, got {text!r}")
    return name, path


@dataclass(slots=True)
class LoRAConfig:
    """The LoRA settings (EngineArgs takes them as its own fields)."""

    enable_lora: bool = setting(
        False,
        "serve LoRA adapters (PEFT folders) over the base model, chosen per request",
        group=LORA,
    )
    lora_modules: list[tuple[str, str]] | None = setting(
        None,
        "adapters served by name: name=path, or vLLM's JSON form "
        '\'{"name": "sql", "path": "/adapters/sql"}\' (repeatable)',
        group=LORA,
        metavar="NAME=PATH",
        nargs="+",
        parse=parse_lora_module,
    )
    max_loras: int = setting(
        1,
        "distinct adapters in one step (device slots); requests of another adapter wait "
        "(default %(default)s)",
        group=LORA,
    )
    max_lora_rank: int = setting(
        16, "the largest adapter rank served (default %(default)s)", group=LORA
    )
    max_cpu_loras: int | None = setting(
        None,
        "adapters kept loaded in host memory, least recently used dropped first "
        "(default: --max-loras)",
        group=LORA,
    )

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        modules = self.lora_modules
        if isinstance(modules, dict):
            modules = list(modules.items())
        elif modules is not None:
            modules = [parse_lora_module(m) if isinstance(m, str) else tuple(m) for m in modules]
        self.lora_modules = modules
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")

    @property
    def lora_config(self) -> LoRAConfig | None:
        """These settings on their own (EngineArgs inherits them), or None when off."""
        if not self.enable_lora:
            return None
        return LoRAConfig(**{f.name: getattr(self, f.name) for f in fields(LoRAConfig)})

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def check_adapter(self, lora: LoRARequest) -> None:
        """Refuse before queuing what adapter_config.json shows we cannot serve
        (the worker checks the weights against the model when it loads them)."""
        if not self.enable_lora:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: LoRA is not enabled (enable_lora)")
        check_adapter_config(lora, read_adapter_config(lora), self.max_lora_rank)

    def served_adapters(self) -> dict[str, LoRARequest]:
        """``lora_modules`` as LoRARequests by name, ids 1, 2, ... in order."""
        out: dict[str, LoRARequest] = {}
        for name, path in self.lora_modules or ():
            if name in out:
                raise ValueError(f"lora_modules: adapter {name!r} is given twice")
            out[name] = LoRARequest(name, len(out) + 1, path)
        return out


def read_adapter_config(lora: LoRARequest) -> dict:
    """adapter_config.json of ``lora``'s folder; ValueError naming the adapter
    when it is missing or not JSON."""
    path = os.path.join(os.path.expanduser(lora.lora_path), "adapter_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"LoRA adapter {lora.lora_name!r}: no adapter_config.json in {lora.lora_path!r}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: unreadable {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: {path} is not a JSON object")
    return config


def check_adapter_config(lora: LoRARequest, config: dict, max_lora_rank: int) -> None:
    """Refuse, naming the adapter and the reason, an adapter_config.json we
    cannot serve: not LoRA, rank above ``max_lora_rank``, DoRA, biases,
    extra trained modules, or target modules beyond the attention and MLP
    projections (TARGET_MODULES)."""
    name = lora.lora_name

    def refuse(reason: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r}: {reason}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"rank r must be a positive int, got {rank!r}")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} is above max_lora_rank={max_lora_rank}")
    for key, reason in _UNSUPPORTED.items():
        if config.get(key):
            raise refuse(reason)
    if config.get("bias", "none") != "none":
        raise refuse(f"bias={config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if targets == "all-linear":  # PEFT's shorthand; the weights say which (the worker checks)
        return
    if isinstance(targets, str):  # a regex in PEFT: we match names, not patterns
        raise refuse(f"target_modules as a pattern ({targets!r}) is not supported")
    bad = sorted(set(targets or ()) - set(TARGET_MODULES))
    if not targets or bad:
        raise refuse(
            f"unsupported target module(s) {', '.join(bad) or '(none given)'}; "
            f"supported: {', '.join(TARGET_MODULES)}"
        )
