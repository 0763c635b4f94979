"""EngineCore: schedule -> execute -> update, synchronously or overlapped.

With async (overlap) scheduling, step N+1 is scheduled while step N runs on
the worker: every request that will sample in step N carries one output
placeholder, and the worker feeds its own last sampled token as the next
input. Both loops produce the same tokens.

Speculative decoding overlaps steps only while no drafts are proposed: a step
that verifies drafts runs alone, since how many it accepts decides where the
next step starts, so the loop is synchronous while drafts keep coming and
overlapped again once the proposer finds nothing (text that does not repeat).

A structured request's bitmask for step N+1 depends on the token step N
samples. Executors with ``defers_grammar_bitmask`` accept a pending mask
(a Future their worker waits on right before sampling): the engine sends step
N+1 at once and fills its mask after applying step N. Other executors get a
concrete mask, so steps do not overlap while structured requests sample.

An executor whose workers can come back (RemoteExecutor) ``can_reinitialize``
and fails steps with a ConnectionError while they are gone: the engine front
then calls ``discard_requests`` and, until it succeeds, ``reinitialize``.

The executor reports the KV cache it allocated (a KVCacheSpec); the engine
owns the configs sized from it (``scheduler_config``, ``cache_config``) and
answers for its scheduler (``stats()``, ``num_free_blocks()``,
``subscribe_kv_events``, ``structured_output``, ``reset_prefix_cache()``), so
no front reaches into the scheduler.

With a KV connector (disaggregated prefill/decode, core/kv/connector.py) the
engine keeps stepping while transfers are pending, even with no request to
run: such a step is empty but carries the connector's metadata, so the
workers start and report sends; the loop sleeps ~2 ms per such poll step
rather than spin.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.kv.connector import KVConnector
from tokenbudget.core.kv.events import KVEventSubscription
from tokenbudget.core.lora import LoRAConfig
from tokenbudget.core.kv.groups import request_capacity_tokens
from tokenbudget.core.outputs import KVCacheSpec, ModelRunnerOutput, RequestOutput, SchedulerOutput
from tokenbudget.core.request import Request, RequestStatus
from tokenbudget.core.sched.scheduler import Scheduler
from tokenbudget.core.sched.stats import SchedulerStats
from tokenbudget.core.structured.manager import StructuredOutputManager
from tokenbudget.server.executor.base import Executor, as_executor

logger = logging.getLogger(__name__)

# How long a step that only polls KV transfers sleeps (nothing else to run).
TRANSFER_POLL_S = 0.002


class EngineCore:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: Executor | Any,
        structured_output_manager: StructuredOutputManager | None = None,
        *,
        max_model_len_given: bool = False,
        lora_config: LoRAConfig | None = None,
        kv_connector_factory: Callable[[KVCacheSpec], KVConnector] | None = None,
    ) -> None:
        """``executor``: an Executor, or an object with its three methods
        (``as_executor``). The configs are not written to: the engine's own,
        sized by the executor's KVCacheSpec, are ``scheduler_config`` and
        ``cache_config``. ``max_model_len_given``: the user set max_model_len,
        so a KV cache that cannot hold one such request is an error; otherwise
        max_model_len is lowered to what the cache holds, with a warning.
        ``lora_config``: the scheduler's adapter limit (None: LoRA off).
        ``kv_connector_factory``: builds the KV connector (disaggregated
        prefill/decode) from the executor's KVCacheSpec (None: no connector)."""
        sized_by = _kv_size_setting(cache_config)
        executor = as_executor(executor)
        spec = executor.initialize(cache_config, scheduler_config)
        try:
            cache_config = sized_cache_config(cache_config, spec)
            scheduler_config = fit_max_model_len(
                scheduler_config, cache_config, sized_by, max_model_len_given
            )
            kv_connector = None if kv_connector_factory is None else kv_connector_factory(spec)
            self._kv_connector_factory = kv_connector_factory
        except BaseException:
            executor.shutdown()
            raise
        # What max_model_len is while the cache holds it: a reconnect to a
        # smaller cache lowers it, one to a larger cache restores it.
        self._max_model_len = scheduler_config.max_model_len
        self.executor = executor
        self.async_scheduling = scheduler_config.async_scheduling
        self._defer_masks = self.async_scheduling and executor.defers_grammar_bitmask
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            structured_output_manager,
            defer_grammar_bitmask=self._defer_masks,
            lora_config=lora_config,
            kv_connector=kv_connector,
        )
        # Steps sent to the executor whose outputs have not been applied.
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()

    # -- the front: what callers may ask of the engine's scheduler ------------------------
    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings (max_model_len as the KV cache allows it)."""
        return self.scheduler.scheduler_config

    @property
    def cache_config(self) -> CacheConfig:
        """The KV cache's settings, ``num_blocks`` and ``num_offload_blocks``
        as the workers allocated them."""
        return self.scheduler.cache_config

    @property
    def structured_output(self) -> StructuredOutputManager | None:
        """The grammar manager (None: structured output is off)."""
        return self.scheduler.structured_output_manager

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def num_free_blocks(self) -> int:
        """Device KV blocks free now (evictable cached blocks included)."""
        return self.scheduler.kv_cache_manager.num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (both KV tiers); refused (False) while a
        request holds blocks or host slots."""
        return self.scheduler.reset_prefix_cache()

    def subscribe_kv_events(self, max_pending: int) -> KVEventSubscription | None:
        """A subscription to the KV cache events (core/kv/events.py), a
        snapshot first; None when the events are off. It outlives
        ``discard_requests`` (its subscribers see every block cleared)."""
        events = self.scheduler.kv_tiering.events
        return None if events is None else events.subscribe(max_pending)

    def add_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(exc)`` runs when a worker fails, even while the engine idles."""
        self.executor.add_failure_callback(callback)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> list[str]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids) -> list[str]:
        """Finish requests whose stop condition the front found (a stop string)."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        s = self.scheduler
        return s.has_unfinished_requests() or bool(self._in_flight) or s.has_pending_transfers()

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs that became known."""
        if self.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        if so.is_empty and so.kv_connector_metadata is None:
            self._flush_finished(so)
            self._wait_for_grammars()
            self._wait_for_transfers()
            return self.scheduler.take_side_outputs()
        # Empty but with connector metadata: a poll step (its reply reports sends).
        result = self.executor.execute_model(so).result()
        outputs = self.scheduler.update_from_output(so, result)
        if so.is_empty:
            self._wait_for_transfers()
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        # Keep at most two steps in flight: schedule N+1, then wait for N.
        sent = poll = False
        s = self.scheduler
        outputs: list[RequestOutput] = []
        if (
            (not self._defer_masks and any(so.structured_req_ids for so, _ in self._in_flight))
            or s.num_stale_drafts
            or any(so.scheduled_spec_decode_tokens for so, _ in self._in_flight)
        ):
            # The next grammar bitmask must see the tokens those steps sample:
            # with structured requests sampling, steps do not overlap. Nor do
            # they while drafts are verified: how many a step accepts decides
            # where the next one starts, and drafts proposed while a step was
            # in flight are stale.
            while self._in_flight:
                outputs += self._apply_oldest()
        if s.has_unfinished_requests() or s.finished_req_ids or s.has_pending_transfers():
            so = s.schedule()
            poll = so.is_empty
            if not so.is_empty or so.kv_connector_metadata is not None:
                self._in_flight.append((so, self.executor.execute_model(so)))
                sent = True
                if len(self._in_flight) == 1:
                    s.fill_grammar_bitmask(so)  # no earlier step to wait for
            else:
                self._flush_finished(so)
        if not self._in_flight:
            if not outputs:
                self._wait_for_grammars()
                self._wait_for_transfers()
            return outputs + s.take_side_outputs()
        # Only a step that sent work may return without waiting: when nothing
        # could be scheduled, progress needs the in-flight step's output.
        if sent and len(self._in_flight) < 2 and self._can_schedule_more():
            # The step just sent runs while we schedule the next one; outputs
            # made outside a model step (a received first token) go out now.
            return outputs + s.take_side_outputs()
        applies_poll = self._in_flight[0][0].is_empty
        outputs += self._apply_oldest()
        if poll and applies_poll:  # nothing runs: only transfers are pending
            self._wait_for_transfers()
        return outputs

    def _apply_oldest(self) -> list[RequestOutput]:
        so, fut = self._in_flight.popleft()
        try:
            return self.scheduler.update_from_output(so, fut.result())
        finally:
            if self._in_flight:
                # Step N's tokens are in the matchers: step N+1's deferred mask
                # can be filled (its worker has been running the forward
                # meanwhile). Even after an error: the worker waits on it.
                self.scheduler.fill_grammar_bitmask(self._in_flight[0][0])

    def _wait_for_grammars(self) -> None:
        # Nothing runs: rather than spin, sleep until a grammar compiles (briefly,
        # so callers still get to add and abort requests).
        som = self.structured_output
        if som is not None and som.has_pending():
            som.wait_for_compiles(0.02)

    def _wait_for_transfers(self) -> None:
        # Nothing runs but KV transfers are pending: poll every ~2 ms, not spin.
        if self.scheduler.has_pending_transfers():
            time.sleep(TRANSFER_POLL_S)

    def _can_schedule_more(self) -> bool:
        s = self.scheduler
        return any(
            r.num_output_tokens + r.num_output_placeholders < r.max_tokens for r in s.running
        ) or bool(s.waiting)

    def _flush_finished(self, so: SchedulerOutput) -> None:
        # Nothing to run, but workers must still hear about finished requests,
        # evicted encoder outputs and KV to copy out before its blocks are reused.
        if (
            so.finished_req_ids
            or so.free_encoder_mm_hashes
            or so.preempted_req_ids
            or so.kv_swap_out
        ):
            self.executor.execute_model(so).result()

    # -- after a worker failed -----------------------------------------------------------
    def can_recover(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the executor's workers went away or hung (they
        may come back) rather than a bug."""
        return isinstance(exc, ConnectionError) and self.executor.can_reinitialize

    def discard_requests(
        self,
        scheduler_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
    ) -> None:
        """Forget every request and step in flight (their worker is gone): abort
        them all (their KV blocks and grammar matchers are released) and start
        a fresh scheduler (with the configs given, else the same), so nothing
        of the old worker's state survives: its cached prefixes went with its
        KV, and its finished-request ids mean nothing to the next one."""
        self._drop_in_flight()
        old = self.scheduler
        old.finish_requests(list(old.requests), RequestStatus.FINISHED_ABORTED)
        self.scheduler = Scheduler(
            scheduler_config or old.scheduler_config,
            cache_config or old.cache_config,
            old.structured_output_manager,
            defer_grammar_bitmask=self._defer_masks,
            lora_config=old.lora_config,
            kv_connector=old.kv_connector,
        )
        # KV event subscribers stay; they see every block cleared.
        self.scheduler.kv_tiering.take_over_events(old.kv_tiering)

    def reinitialize(self) -> None:
        """Reconnect the executor's workers and initialise them again with the
        same configuration (after discard_requests). A worker may now report
        another KV size (other free memory): the scheduler gets a pool of that
        size, and max_model_len is lowered (with a warning) to what that pool
        holds, or restored up to its start-up value when the pool allows.
        Raises ConnectionError while a worker cannot be reached, or comes
        back with a cache too small for any request."""
        spec = self.executor.reinitialize()
        self._renew_kv_connector(spec)
        cache_config = self.cache_config
        if (spec.num_blocks, spec.num_offload_blocks) != (
            cache_config.num_blocks,
            cache_config.num_offload_blocks or 0,
        ):
            # A refused pool leaves the old settings, so the next attempt
            # compares against them again.
            restored = dataclasses.replace(self.scheduler_config, max_model_len=self._max_model_len)
            try:
                sized = sized_cache_config(cache_config, spec)
                # Lowered even when max_model_len was given: refusing would
                # stop serving every request, not just the longest ones.
                fitted = fit_max_model_len(
                    restored, sized, "the reconnected workers' cache", given=False
                )
            except ValueError as exc:  # not one token fits: wait for a better worker
                raise ConnectionError(
                    f"the workers came back with too small a KV cache: {exc}"
                ) from None
            logger.warning(
                "the workers came back with %d KV blocks (had %d)",
                spec.num_blocks,
                cache_config.num_blocks,
            )
            self.discard_requests(fitted, sized)

    def _renew_kv_connector(self, spec: KVCacheSpec) -> None:
        # Workers that came back registered their KV anew (new transfer
        # agents, new handshakes): a connector built from the old ones would
        # hand peers stale addresses. Requests were discarded before this.
        old = self.scheduler.kv_connector
        if old is not None and self._kv_connector_factory is not None:
            old.shutdown()
            self.scheduler.kv_connector = self._kv_connector_factory(spec)

    def _drop_in_flight(self) -> None:
        for so, fut in self._in_flight:
            fut.cancel()
            if isinstance(so.grammar_bitmask, Future):
                so.grammar_bitmask.cancel()  # releases a worker waiting on it
        self._in_flight.clear()

    def shutdown(self) -> None:
        self._drop_in_flight()
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self.executor.shutdown()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.shutdown()


def _kv_size_setting(cache_config: CacheConfig) -> str:
    """The setting that sizes the KV cache, as the user gave it."""
    if cache_config.num_blocks is not None:
        return f"num_gpu_blocks={cache_config.num_blocks} (--num-gpu-blocks)"
    if cache_config.kv_cache_memory_bytes is not None:
        return f"kv_cache_memory={cache_config.kv_cache_memory_bytes} (--kv-cache-memory)"
    return (
        f"gpu_memory_utilization={cache_config.gpu_memory_utilization:g} "
        "(--gpu-memory-utilization; on CPU the default cache size)"
    )


def sized_cache_config(cache_config: CacheConfig, spec: KVCacheSpec) -> CacheConfig:
    """``cache_config`` with the pool sizes the workers allocated."""
    return dataclasses.replace(
        cache_config,
        num_blocks=spec.num_blocks,
        num_offload_blocks=spec.num_offload_blocks,
        kv_group_windows=spec.kv_group_windows,
    )


def fit_max_model_len(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, sized_by: str, given: bool
) -> SchedulerConfig:
    """A request may grow to max_model_len tokens (plus its draft lookahead),
    and must then still fit in the whole cache alone, or it could never
    finish (vLLM refuses such a cache at start-up too). Refuse when
    max_model_len was ``given``; else return ``scheduler_config`` with
    max_model_len lowered to what the cache holds."""
    capacity = request_capacity_tokens(
        cache_config.num_blocks, cache_config.block_size, cache_config.kv_group_windows
    )
    lookahead = scheduler_config.num_speculative_tokens
    need = scheduler_config.max_model_len + lookahead
    if need <= capacity:
        return scheduler_config
    spec = f" + num_speculative_tokens={lookahead}" if lookahead else ""
    what = (
        f"{sized_by} gives {capacity} tokens of KV cache "
        f"({cache_config.num_blocks - 1} blocks of {cache_config.block_size}), less than "
        f"max_model_len={scheduler_config.max_model_len}{spec} needs ({need})"
    )
    if given or capacity - lookahead < 1:
        raise ValueError(
            f"{what}; raise the KV cache (--num-gpu-blocks / --kv-cache-memory / "
            "--gpu-memory-utilization) or lower max_model_len (--max-model-len)"
        )
    logger.warning(
        "%s: max_model_len lowered to %d (set --max-model-len to choose, or give "
        "the KV cache more room)",
        what,
        capacity - lookahead,
    )
    return dataclasses.replace(scheduler_config, max_model_len=capacity - lookahead)
