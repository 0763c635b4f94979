"""Encoder (vision) outputs: a cache counted in embeddings, shared by mm_hash.

An entry is referenced by every request that still needs it (its placeholder
is not fully computed yet). Unreferenced entries stay cached, so a later
request with the same image skips the encoder, until space is needed: then
they are evicted oldest first and their hashes are sent to the workers in
``SchedulerOutput.free_encoder_mm_hashes``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # mm_hash -> ids of requests referencing it.
        self.cached: dict[str, set[str]] = {}
        # Unreferenced but still cached: mm_hash -> num embeddings, oldest first.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.num_freeable_slots = cache_size
        self._freed: list[str] = []
        self.num_encoder_runs = 0

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """True when the item's output is cached; the request then references it."""
        mm_hash = request.mm_features[input_id].mm_hash
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:
            num = self.freeable.pop(mm_hash)
            self.num_freeable_slots -= num
        refs.add(request.request_id)
        return True

    def can_allocate(
        self, request: Request, input_id: int, compute_budget: int, num_embeds_to_schedule: int
    ) -> bool:
        """Whether the item fits this step's compute budget and the cache,
        evicting unreferenced entries (oldest first) only if that suffices."""
        num = request.mm_features[input_id].length
        if num > compute_budget:
            return False
        need = num + num_embeds_to_schedule
        if need <= self.num_free_slots:
            return True
        if need > self.num_freeable_slots:
            return False
        while need > self.num_free_slots:
            mm_hash, n = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self._freed.append(mm_hash)
            self.num_free_slots += n
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        feature = request.mm_features[input_id]
        self.cached.setdefault(feature.mm_hash, set()).add(request.request_id)
        self.num_free_slots -= feature.length
        self.num_freeable_slots -= feature.length
        self.num_encoder_runs += 1

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        feature = request.mm_features[input_id]
        refs = self.cached.get(feature.mm_hash)
        if refs is None or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            self.freeable[feature.mm_hash] = feature.length
            self.num_freeable_slots += feature.length

    def free(self, request: Request) -> None:
        for i in range(len(request.mm_features)):
            self.free_encoder_input(request, i)

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def usage(self) -> float:
        return 1.0 - self.num_free_slots / self.cache_size if self.cache_size else 0.0
