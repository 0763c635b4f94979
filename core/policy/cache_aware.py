"""SGLang-style scheduling policies inside the token-budget scheduler.

- ``WaitingOrder``: orders the waiting queue each step for the cache-aware
  and other non-vLLM policies (lpm, dfs-weight, lof, random), with in-batch
  prefix deprioritisation and aging.
- ``VictimOrder``: who is preempted on memory shortage: vLLM's order or
  SGLang's retract order.

SGLang's admission reserve (``new_token_ratio``) is in core/policy/reserve.py.

Cache-aware policies measure a waiting request's cached prefix with our block
hash index: the number of leading block hashes found in the block pool.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenbudget.core.config import SchedulerConfig
from tokenbudget.core.policy.base import Admission, SchedulingPolicy

if TYPE_CHECKING:
    from tokenbudget.core.kv import KVCacheManager
    from tokenbudget.core.policy.base import StepView
    from tokenbudget.core.policy.queues import FCFSQueue
    from tokenbudget.core.request import Request

# Policies that reorder the FCFS deque each step.
REORDERING_POLICIES = ("lpm", "dfs-weight", "lof", "random")
# Policies whose order depends on the prefix cache.
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")


def cached_prefix_blocks(kv: KVCacheManager, req: Request, hint: int = -1) -> int:
    """Leading blocks of ``req`` present in the prefix cache.

    Binary search over the hash chain: a block is cached only if it was
    allocated after its whole prefix, and freeing releases a chain tail first,
    so cached blocks of a chain nearly always form a prefix. An ordering
    heuristic only; admission looks up the exact hit. ``hint`` (the previous
    answer) settles the common unchanged case in two lookups.
    """
    hashes = req.block_hashes
    cached = kv.block_pool.cached
    if (
        0 <= hint <= len(hashes)
        and (hint == 0 or hashes[hint - 1] in cached)
        and (hint == len(hashes) or hashes[hint] not in cached)
    ):
        return hint
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in cached:
            lo = mid
        else:
            hi = mid - 1
    return lo


class WaitingOrder(SchedulingPolicy):
    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.policy = config.policy
        self.block_size = block_size
        self.lpm_fallback = config.lpm_fallback_queue_len
        self.window = config.cache_aware_window
        self.check_tokens = config.in_batch_prefix_check_threshold
        self.deprioritize_tokens = config.in_batch_prefix_deprioritize_threshold
        self.aging_s = config.aging_bound_s
        self._rng = random.Random(config.random_seed)
        # Last cached-prefix length per request id (see cached_prefix_blocks).
        self._hints: dict[str, int] = {}

    def reorder(self, waiting: FCFSQueue, kv: KVCacheManager, now: float) -> set[str]:
        """Reorder ``waiting`` in place for this step; return the ids of the
        requests deprioritised this round (they keep their place but are not
        admitted in this step)."""
        if len(waiting) <= 1:
            return set()
        if self.policy == "lpm" and len(waiting) > self.lpm_fallback:
            # Matching every waiting request costs too much in a long queue.
            # Timsort is linear on the already-ordered common case.
            waiting.reorder(sorted(waiting, key=lambda r: r.arrival_time))
            return set()
        reqs = list(waiting)
        rest: list[Request] = []
        if self.policy == "dfs-weight" and len(reqs) > self.window:
            reqs, rest = reqs[: self.window], reqs[self.window :]
        aged: list[Request] = []
        if self.aging_s > 0 and self.policy in CACHE_AWARE_POLICIES:
            # Cache-cold requests can starve behind a stream of hot ones;
            # past the bound they go first, in arrival order.
            deadline = now - self.aging_s
            aged = [r for r in reqs if r.arrival_time <= deadline]
            if aged:
                old = {id(r) for r in aged}
                reqs = [r for r in reqs if id(r) not in old]
                aged.sort(key=lambda r: r.arrival_time)
        deprioritized: set[str] = set()
        if self.policy == "lpm":
            prefix = self._cached_prefixes(kv, reqs)
            reqs.sort(key=lambda r: -prefix[id(r)])  # stable: FCFS among equals
            deprioritized = self._in_batch_deprioritize(reqs, prefix)
        elif self.policy == "dfs-weight":
            prefix = self._cached_prefixes(kv, reqs)
            reqs = _dfs_weight_order(reqs, prefix)
            deprioritized = self._in_batch_deprioritize(reqs, prefix)
        elif self.policy == "lof":
            reqs.sort(key=lambda r: -(r.max_tokens - r.num_output_tokens))
        elif self.policy == "random":
            self._rng.shuffle(reqs)
        ordered = aged + reqs
        if deprioritized:
            ordered = [r for r in ordered if r.request_id not in deprioritized] + [
                r for r in ordered if r.request_id in deprioritized
            ]
        waiting.reorder(ordered + rest if rest else ordered)
        return deprioritized

    def order_waiting(
        self, step: StepView, waiting: FCFSQueue, running: list[Request], kv: KVCacheManager
    ) -> Admission | None:
        deprioritized = self.reorder(waiting, kv, step.now)
        return Admission(deprioritized, []) if deprioritized else None

    def _cached_prefixes(self, kv: KVCacheManager, reqs: list[Request]) -> dict[int, int]:
        old = self._hints
        hints: dict[str, int] = {}
        prefix: dict[int, int] = {}
        for r in reqs:
            n = cached_prefix_blocks(kv, r, old.get(r.request_id, -1))
            hints[r.request_id] = n
            prefix[id(r)] = n
        self._hints = hints  # requests that left the window drop out
        return prefix

    def _in_batch_deprioritize(self, reqs: list[Request], prefix: dict[int, int]) -> set[str]:
        """Among requests with a short cached prefix, one that shares at least
        ``deprioritize_tokens`` with a request earlier in this round's order
        waits a round: the shared part is computed once and then hit."""
        if self.check_tokens <= 0 or self.deprioritize_tokens <= 0:
            return set()
        # Hashes are chained, so sharing the first k blocks is sharing hash k-1.
        k = -(-self.deprioritize_tokens // self.block_size)
        seen: set[bytes] = set()
        out: set[str] = set()
        for r in reqs:
            if prefix[id(r)] * self.block_size > self.check_tokens or len(r.block_hashes) < k:
                continue
            key = r.block_hashes[k - 1]
            if key in seen:
                out.add(r.request_id)
            else:
                seen.add(key)
        return out


def _dfs_weight_order(reqs: list[Request], prefix: dict[int, int]) -> list[Request]:
    """Walk the tree of cached prefixes depth first, heavier subtrees first, so
    requests sharing a cached prefix are admitted together (SGLang dfs-weight).

    A request sits at the node of its last cached block; a node's weight is the
    number of requests at or below it. Hashes are chained, so a node names its
    whole path: the tree is built from the distinct nodes only, walking each
    one's chain once."""
    root = b""
    at_node: dict[bytes, list[Request]] = {}
    for r in reqs:
        n = prefix[id(r)]
        at_node.setdefault(r.block_hashes[n - 1] if n else root, []).append(r)
    children: dict[bytes, list[bytes]] = {}
    weight: dict[bytes, int] = {root: len(reqs)}
    for node, members in at_node.items():
        if node == root:
            continue
        first = members[0]
        parent = root
        for h in first.block_hashes[: prefix[id(first)]]:
            if h not in weight:
                weight[h] = 0
                children.setdefault(parent, []).append(h)
            weight[h] += len(members)
            parent = h
    # Post-order: a node's subtrees (heaviest first) before the requests that
    # stop at the node itself, so the deepest cached prefixes go first and
    # cold requests (at the root) last.
    out: list[Request] = []
    stack: list[tuple[bytes, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(at_node[node])
            continue
        # Walk down a run of single-child nodes (one per cached block) in one go.
        if node in at_node:
            stack.append((node, True))
        kids = children.get(node)
        while kids is not None and len(kids) == 1:
            node = kids[0]
            if node in at_node:
                stack.append((node, True))
            kids = children.get(node)
        if kids:
            # Heaviest popped first; ties keep first-seen (arrival) order.
            kids = sorted(kids, key=lambda h: weight[h], reverse=True)
            stack.extend((h, False) for h in reversed(kids))
    return out


def make_victim_picker(config: SchedulerConfig) -> Callable[[list[Request]], Request]:
    """Who to preempt on memory shortage: vLLM's order (the last admitted, or
    the worst priority) or SGLang's retract order (fewest generated tokens
    first, then the longest prompt: the cheapest to recompute per token lost)."""
    if config.preemption_mode == "retract":
        return lambda running: min(
            running, key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens)
        )
    if config.policy == "priority":
        sign = -1 if config.priority_descending else 1
        return lambda running: max(running, key=lambda r: (sign * r.priority, r.arrival_time))
    return lambda running: running[-1]


class VictimOrder(SchedulingPolicy):
    """Victim choice on memory shortage (``preemption_mode``, see make_victim_picker)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._pick = make_victim_picker(config)

    def pick_victim(self, running: list[Request]) -> Request:
        return self._pick(running)
