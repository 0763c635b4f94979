"""LoRA adapters in the worker: loading PEFT folders, and moving adapters
between host memory and the device slots of the LoRA layers
(worker/lora_layers.py).

An adapter is read and checked when a request first names it (a bad one
fails that request alone, with one line naming the adapter and the reason)
and kept in host memory, least recently used dropped beyond
``max_cpu_loras``. Each step, the adapters of its requests get device slots:
the scheduler guarantees at most ``max_loras`` distinct ones
(core/sched/lora_gate.py), so the least recently used slot whose adapter
this step does not use is always there to refill.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from tokenbudget.core.failures import RequestFailure, describe
from tokenbudget.core.lora import LoRAConfig, LoRARequest, check_adapter_config, read_adapter_config
from tokenbudget.core.outputs import SchedulerOutput
from tokenbudget.worker.lora_layers import LoRALayer, LoRAStep, attach_lora_layers

logger = logging.getLogger(__name__)

_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(slots=True)
class LoadedAdapter:
    """An adapter in host memory: per module name, (A [r, in], scale * B [out, r])."""

    lora: LoRARequest
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def adapter_scale(config: dict) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (PEFT's rule)."""
    r = config["r"]
    alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def load_adapter(
    lora: LoRARequest, max_rank: int, layers: dict[str, LoRALayer], dtype: torch.dtype
) -> LoadedAdapter:
    """Read and check ``lora``'s folder against the model's LoRA layers;
    ValueError naming the adapter and the reason."""
    config = read_adapter_config(lora)
    check_adapter_config(lora, config, max_rank)
    tensors = _read_tensors(lora)
    rank, scale = config["r"], adapter_scale(config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, part = _module_of(lora, key)
        if module not in layers:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the model has no module {module!r}")
        pairs.setdefault(module, {})[part] = t
    weights = {}
    for module, ab in pairs.items():
        a, b = ab.get("A"), ab.get("B")
        in_f, out_f = layers[module].shape
        if a is None or b is None or a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: {module}: expected lora_A [{rank}, {in_f}] "
                f"and lora_B [{out_f}, {rank}], got "
                f"{None if a is None else list(a.shape)} and {None if b is None else list(b.shape)}"
            )
        weights[module] = (a.to(dtype), (b.float() * scale).to(dtype))
    if not weights:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: no LoRA weights in its safetensors")
    return LoadedAdapter(lora, rank, weights)


def _read_tensors(lora: LoRARequest) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(os.path.expanduser(lora.lora_path), "adapter_model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(
            f"LoRA adapter {lora.lora_name!r}: no adapter_model.safetensors in {lora.lora_path!r}"
        )
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: unreadable {path}: {exc}") from None


def _module_of(lora: LoRARequest, key: str) -> tuple[str, str]:
    """The model module a tensor of the adapter belongs to, and "A" or "B"."""
    name = key.removeprefix(_PREFIX)
    if "lora_embedding" in name:
        raise ValueError(
            f"LoRA adapter {lora.lora_name!r}: embedding/lm_head adapters are not supported ({key})"
        )
    for part, suffix in zip("AB", _SUFFIXES):
        if name.endswith(suffix):
            module = name.removesuffix(suffix)
            if module.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head"):
                raise ValueError(
                    f"LoRA adapter {lora.lora_name!r}: embedding/lm_head adapters are not "
                    f"supported ({key})"
                )
            return module, part
    raise ValueError(f"LoRA adapter {lora.lora_name!r}: unsupported tensor {key!r}")


class LoRAManager:
    """The model's LoRA layers, the adapters in host memory and who holds
    which device slot (slot 0: the base model)."""

    def __init__(
        self, model: torch.nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.step = LoRAStep()
        self.layers = attach_lora_layers(
            model, config.max_loras + 1, config.max_lora_rank, self.step
        )
        self.narrowest = min(min(layer.shape) for layer in self.layers.values())
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()  # LRU last
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU last
        self.ranks: dict[int, int] = {}  # slot -> its adapter's rank
        self.requests: dict[str, int] = {}  # request id -> lora id
        self.adapters: dict[int, LoRARequest] = {}  # every lora id a request holds
        self.num_slot_loads = 0  # adapters copied into a device slot (for tests, benchmarks)

    def update(self, so: SchedulerOutput) -> dict[str, RequestFailure]:
        """Follow the step's requests in and out; the new ones whose adapter
        cannot be loaded fail (the others go on)."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        failed = {}
        for new in so.scheduled_new_reqs:
            try:
                self.add_request(new.req_id, new.lora_request)
            except ValueError as exc:
                failed[new.req_id] = describe(exc)
        return failed

    def add_request(self, req_id: str, lora: LoRARequest | None) -> None:
        """Note ``req_id``'s adapter, loading it to host memory now: a bad
        adapter fails this request here (ValueError)."""
        if lora is None:
            return
        known = self.adapters.get(lora.lora_int_id)
        if known is not None and known.lora_path != lora.lora_path:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: id {lora.lora_int_id} already names "
                f"{known.lora_path!r}"
            )
        self._hosted(lora)
        self.adapters[lora.lora_int_id] = lora
        self.requests[req_id] = lora.lora_int_id

    def _hosted(self, lora: LoRARequest) -> LoadedAdapter:
        lid = lora.lora_int_id
        adapter = self.host.get(lid)
        if adapter is None:
            adapter = load_adapter(lora, self.config.max_lora_rank, self.layers, self.dtype)
            self.host[lid] = adapter
            while len(self.host) > self.config.num_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lid)
        return adapter

    def prepare(self, req_ids: list[str], query_lens: np.ndarray) -> None:
        """Set the forward's grouping for these requests' packed tokens,
        filling device slots for adapters not resident."""
        ids = [self.requests.get(r, 0) for r in req_ids]
        used = set(ids) - {0}
        if not used:
            self.step.clear()
            return
        if len(used) > self.config.max_loras:
            raise RuntimeError(
                f"{len(used)} adapters in one step, max_loras={self.config.max_loras}"
            )
        slot_of = {lid: self._slot(lid, used) for lid in used}
        slot_of[0] = 0
        slots = np.fromiter((slot_of[i] for i in ids), np.int64, len(ids))
        shape = (self.config.max_lora_rank, self.narrowest)
        self.step.set(np.repeat(slots, query_lens), self.ranks, shape, self.device, self.dtype)

    def _slot(self, lid: int, used: set[int]) -> int:
        """``lid``'s device slot, evicting the least recently used adapter
        that this step does not use."""
        slot = self.slots.get(lid)
        if slot is not None:
            self.slots.move_to_end(lid)
            return slot
        if len(self.slots) < self.config.max_loras:
            slot = len(self.slots) + 1
        else:
            victim = next(v for v in self.slots if v not in used)
            slot = self.slots.pop(victim)
        adapter = self._hosted(self.adapters[lid])
        for name, layer in self.layers.items():
            layer.fill(slot, *adapter.weights.get(name, (None, None)))
        self.slots[lid] = slot
        self.ranks[slot] = adapter.rank
        self.num_slot_loads += 1
        return slot


class NoLoRA:
    """The runner's LoRA calls when LoRA is off: they do nothing."""

    @staticmethod
    def update(so: SchedulerOutput) -> dict[str, RequestFailure]:
        return {}

    @staticmethod
    def prepare(req_ids: list[str], query_lens: np.ndarray) -> None:
        return None


NO_LORA = NoLoRA()


def enable_lora(runner, config: LoRAConfig) -> None:
    """Give ``runner`` (a ModelRunner whose KV cache is not allocated yet) its
    LoRA layers. The LoRA forward regroups tokens per step, which neither the
    compiled decoder nor CUDA graphs follow: LoRA runs eager."""
    if not runner.enforce_eager:
        logger.info("LoRA: running eager (no compiled decoder or CUDA graphs with LoRA)")
        runner.enforce_eager = True
    runner.lora = LoRAManager(runner.model, config, runner.device, runner.dtype)
