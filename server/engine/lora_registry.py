"""The LoRA adapters a server serves by name: ``--lora-modules`` at start,
LoadLoRAAdapter / UnloadLoRAAdapter at run time (thread-safe).

Each load gets a new adapter id, never reused: a request keeps its
LoRARequest (and so its id) after the name is unloaded or loaded again, so
its prefix-cache blocks and the worker's slot stay its adapter's. An
adapter's adapter_config.json is checked before its name is served; the
worker reads its weights when the first request under it arrives.
"""

from __future__ import annotations

import threading

from tokenbudget.core.lora import LoRAConfig, LoRARequest


class LoRARegistry:
    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in config.lora_modules or ():
            self.load(name, path)

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT folder ``path`` as ``name``; ValueError (naming the
        adapter) when the name is taken or the adapter cannot be served."""
        if not name or not path:
            raise ValueError("lora_name and lora_path must not be empty")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
            lora = LoRARequest(name, self._next_id, path)
            self.config.check_adapter(lora)
            self._next_id += 1
            self._by_name[name] = lora
            return lora

    def unload(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (requests running under it finish); KeyError if unknown."""
        with self._lock:
            if name not in self._by_name:
                raise KeyError(f"LoRA adapter {name!r} is not loaded")
            return self._by_name.pop(name)

    def resolve(self, name: str) -> LoRARequest:
        """The adapter served as ``name``; ValueError naming it when there is none."""
        with self._lock:
            lora = self._by_name.get(name)
            served = sorted(self._by_name)
        if lora is None:
            raise ValueError(
                f"lora_name: unknown LoRA adapter {name!r} (served: {', '.join(served) or 'none'})"
            )
        return lora

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())
