"""The decode engine's KV connector: a request whose prompt a prefill engine
computes registers its freshly allocated blocks with that prefill's
bootstrap listener, and waits (in WAITING_FOR_REMOTE_KVS) for the reply
that says its KV and first token arrived.

Each registration is one blocking gRPC call on a pool thread; the engine's
step thread only starts them and collects what they learnt. A request that
ends while its registration may still be in flight keeps its blocks until
the prefill confirms (KVBootstrap.Cancel) that nothing writes into them any
more, or cannot be reached (a dead process writes nothing)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from tokenbudget.core.kv.connector import DECODE, ConnectorEvents, KVConnector, KVConnectorMetadata
from tokenbudget.core.request import Request
from tokenbudget.proto import kv_bootstrap_pb2 as pb
from tokenbudget.server.engine.disagg.bootstrap import BootstrapClient, address, prompt_digest

logger = logging.getLogger("tokenbudget.server")

# Registrations waiting at once; each holds a thread until its KV arrives.
MAX_REGISTRATIONS = 64
CANCEL_TIMEOUT_S = 5.0
# A fetch's states: queued for a thread; call open; failed without the
# prefill's answer (it may still be writing); cancelled by request_finished.
QUEUED, REGISTERING, UNCONFIRMED, CANCELLED = "queued", "registering", "unconfirmed", "cancelled"
# Refusals that mean the prefill never took the registration (nothing to cancel).
NOT_REGISTERED = frozenset(
    (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,
    )
)


@dataclass(slots=True, eq=False)
class _Fetch:
    request_id: str
    room: int
    host: str
    port: int
    request: pb.RegisterRequest
    deadline: float
    state: str = QUEUED
    call: Any = None

    @property
    def where(self) -> str:
        return f"prefill {address(self.host, self.port)}, room {self.room}"


def skip_tokens(num_local_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens the decode does not fetch. Local prefix hits are
    whole blocks; a whole-prompt hit the scheduler capped one token short
    (to compute the last token's logits) still holds that token's KV in its
    full cached block, so it counts as the whole prompt."""
    if num_local_tokens % block_size == 0:
        return num_local_tokens
    if num_local_tokens == num_prompt_tokens - 1:
        return num_prompt_tokens
    raise ValueError(
        f"{num_local_tokens} local tokens is not whole blocks of {block_size} "
        f"(prompt of {num_prompt_tokens})"
    )


class DecodeConnector(KVConnector):
    """``handshakes``: this engine's KV transfer handshake per TP rank
    (KVCacheSpec.kv_transfer_handshakes); ``timeout``: how long a request
    waits for its KV; ``secret``: the worker secret the prefills require."""

    def __init__(
        self,
        handshakes: tuple[bytes, ...] | list[bytes],
        block_size: int,
        timeout: float = 30.0,
        secret: str | None = None,
        cancel_timeout: float = CANCEL_TIMEOUT_S,
    ) -> None:
        if not handshakes:
            raise ValueError("handshakes must hold one entry per TP rank, got none")
        if block_size < 1 or timeout <= 0:
            raise ValueError(
                f"block_size must be >= 1 and timeout > 0, got {block_size}, {timeout}"
            )
        self.handshakes = list(handshakes)
        self.block_size = block_size
        self.timeout = timeout
        self.cancel_timeout = cancel_timeout
        self._client = BootstrapClient(secret)
        self._pool = futures.ThreadPoolExecutor(MAX_REGISTRATIONS, thread_name_prefix="kv-register")
        self._cancel_pool = futures.ThreadPoolExecutor(8, thread_name_prefix="kv-cancel")
        self._lock = threading.Lock()
        self._fetches: dict[str, _Fetch] = {}
        self._received: set[str] = set()
        self._events = ConnectorEvents()
        # Blocks each request asked its prefill for (until it finishes), and totals.
        self.blocks_requested: dict[str, int] = {}
        self.stats = {"registrations": 0, "blocks_requested": 0, "received": 0, "failed": 0}

    # -- the engine's step thread (KVConnector) --

    def num_remote_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if params is None or params.role != DECODE or request.request_id in self._received:
            return 0
        return max(request.num_prompt_tokens - num_computed_tokens, 0)

    def on_allocated(self, request: Request, block_ids: list[int], num_local_tokens: int) -> None:
        params = request.kv_transfer_params
        if params is None or params.role != DECODE:
            return
        num_prompt = request.num_prompt_tokens
        end = -(-num_prompt // self.block_size)
        try:
            skip = skip_tokens(num_local_tokens, num_prompt, self.block_size)
            if len(block_ids) < end:
                raise ValueError(f"{len(block_ids)} blocks cannot hold a {num_prompt}-token prompt")
        except ValueError as exc:  # the scheduler's bug: this request fails, not the engine
            with self._lock:
                self._events.failed[request.request_id] = f"cannot fetch its KV: {exc}"
            return
        dst = list(block_ids[skip // self.block_size : end])
        fetch = _Fetch(
            request.request_id,
            params.room,
            params.bootstrap_host,
            params.bootstrap_port,
            pb.RegisterRequest(
                room=params.room,
                request_id=request.request_id,
                handshakes=self.handshakes,
                skip_tokens=skip,
                dst_block_ids=dst,
                num_prompt_tokens=num_prompt,
                block_size=self.block_size,
                prompt_digest=prompt_digest(request.prompt_token_ids),
            ),
            deadline=time.monotonic() + self.timeout,
        )
        with self._lock:
            self._fetches[request.request_id] = fetch
            self.blocks_requested[request.request_id] = len(dst)
            self.stats["registrations"] += 1
            self.stats["blocks_requested"] += len(dst)
        self._pool.submit(self._register, fetch)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        params = request.kv_transfer_params
        if params is None or params.role != DECODE:
            return False
        rid = request.request_id
        with self._lock:
            self._received.discard(rid)
            self.blocks_requested.pop(rid, None)
            fetch = self._fetches.get(rid)
            if fetch is None:
                return False
            if fetch.state == CANCELLED:
                return True  # told twice: its cancel is still under way
            started = fetch.state in (REGISTERING, UNCONFIRMED)
            fetch.state = CANCELLED
            if not started:  # never reached the prefill: nothing can write
                del self._fetches[rid]
                return False
            call = fetch.call
        if call is not None:
            call.cancel()
        self._cancel_pool.submit(self._cancel, fetch)
        return True

    def build_metadata(self) -> KVConnectorMetadata | None:
        return None  # the decode's workers only receive

    def on_worker_output(self, finished_sending: set[str], failed_sending: dict[str, str]) -> None:
        pass

    def take_events(self) -> ConnectorEvents:
        with self._lock:
            events, self._events = self._events, ConnectorEvents()
        return events

    def has_pending(self) -> bool:
        with self._lock:
            events = self._events
            return bool(self._fetches or events.received or events.failed or events.freeable)

    def shutdown(self) -> None:
        with self._lock:
            calls = [f.call for f in self._fetches.values() if f.call is not None]
            for fetch in self._fetches.values():
                fetch.state = CANCELLED
        for call in calls:
            call.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._cancel_pool.shutdown(wait=True, cancel_futures=False)
        self._client.close()

    # -- pool threads --

    def _register(self, fetch: _Fetch) -> None:
        """Register ``fetch`` with its prefill and wait for the one reply."""
        with self._lock:
            if fetch.state != QUEUED:
                return
            fetch.state = REGISTERING
        remaining = fetch.deadline - time.monotonic()
        reply, failure, maybe_writing = None, None, False
        if remaining <= 0:  # waited for a thread past its deadline
            self._settle(fetch, None, self._deadline_message(fetch), maybe_writing)
            return
        try:
            stub = self._client.stub(fetch.host, fetch.port)
            call = stub.Register(fetch.request, timeout=remaining, metadata=self._client.metadata)
            with self._lock:
                fetch.call = call
                cancelled = fetch.state == CANCELLED
            if cancelled:
                call.cancel()
                return
            reply = next(call, None)
            maybe_writing = reply is None  # closed without the prefill's answer
            call.cancel()  # the one reply is all there is
        except grpc.RpcError as exc:
            failure = self._rpc_failure(fetch, exc)
            maybe_writing = exc.code() not in NOT_REGISTERED
        self._settle(fetch, reply, failure, maybe_writing)

    def _settle(
        self,
        fetch: _Fetch,
        reply: pb.RegisterReply | None,
        failure: str | None,
        maybe_writing: bool,
    ) -> None:
        """Record how ``fetch`` ended. Without the prefill's own answer its
        send may still be writing: the fetch stays (UNCONFIRMED) so that
        request_finished cancels it on the prefill before the blocks free."""
        rid = fetch.request_id
        with self._lock:
            if fetch.state == CANCELLED or self._fetches.get(rid) is not fetch:
                return  # request_finished took over
            kind = reply.WhichOneof("result") if reply is not None else None
            if kind is None and maybe_writing:
                fetch.state = UNCONFIRMED
            else:
                del self._fetches[rid]
            if kind == "done":
                self._received.add(rid)
                self._events.received[rid] = reply.done.first_token_id
                self.stats["received"] += 1
                return
            if kind == "error":
                failure = f"{fetch.where}: {reply.error.message}"
            elif failure is None:
                failure = f"{fetch.where}: the registration stream closed without a reply"
            self._events.failed[rid] = failure
            self.stats["failed"] += 1

    def _cancel(self, fetch: _Fetch) -> None:
        """Ask the prefill to stop writing into ``fetch``'s blocks, then free them."""
        try:
            self._client.stub(fetch.host, fetch.port).Cancel(
                pb.CancelRequest(room=fetch.room),
                timeout=self.cancel_timeout,
                metadata=self._client.metadata,
            )
        except grpc.RpcError as exc:
            logger.warning(
                "request %s: %s did not confirm the cancel (%s: %s); freeing its blocks",
                fetch.request_id,
                fetch.where,
                exc.code().name,
                exc.details(),
            )
        with self._lock:
            if self._fetches.get(fetch.request_id) is fetch:
                del self._fetches[fetch.request_id]
            self._events.freeable.append(fetch.request_id)

    def _deadline_message(self, fetch: _Fetch) -> str:
        return f"no KV from {fetch.where} within {self.timeout:g} s (--disaggregation-timeout)"

    def _rpc_failure(self, fetch: _Fetch, exc: grpc.RpcError) -> str:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return self._deadline_message(fetch)
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"{fetch.where} unreachable: {exc.details()}"
        return f"{fetch.where} refused the registration: {code.name}: {exc.details()}"
