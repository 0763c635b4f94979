"""The prefill engine's KV connector: hold a finished request's blocks until
its decode has registered (by room, on the bootstrap listener) and the
workers have written them into the decode's blocks, then answer the decode
and free them.

Two threads meet here: the engine's step thread (the KVConnector calls) and
the listener's handler threads (``register``, ``expire``, ``stream_closed``,
``cancel_room``). One lock guards all state; a room is in at most one of
``_waiting`` (registered, no request yet), ``_held`` (request finished, no
registration yet) or ``_by_room`` (matched: a send pending or in flight).
Rooms that are done with (served, cancelled, expired) are remembered for a
while, so a late registration or Cancel for them is answered at once."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenbudget.core.kv.connector import (
    PREFILL,
    ConnectorEvents,
    KVConnector,
    KVConnectorMetadata,
    KVSend,
)
from tokenbudget.core.request import Request, RequestStatus
from tokenbudget.server.engine.disagg.bootstrap import (
    BootstrapServer,
    Registration,
    done_reply,
    error_reply,
    prompt_digest,
)

logger = logging.getLogger("tokenbudget.server")

# Rooms done with, remembered so late calls for them are answered at once.
MAX_SETTLED_ROOMS = 1 << 16
_OK = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass(slots=True)
class _Held:
    """A finished prefill request whose blocks wait for its decode."""

    request_id: str
    room: int
    block_ids: list[int]
    num_prompt_tokens: int
    prompt_digest: bytes
    first_token: int
    finished_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True, eq=False)
class _Send:
    """A matched pair: the KVSend for the workers, and the decode's call to answer."""

    kv: KVSend
    room: int
    reg: Registration
    first_token: int
    emitted: bool = False
    cancelled: bool = False
    quiet: threading.Event = field(default_factory=threading.Event)


def _mismatch(held: _Held, reg: Registration) -> str | None:
    """Why the decode's prompt is not the prefill's, or None."""
    if reg.num_prompt_tokens != held.num_prompt_tokens:
        return (
            f"prompt lengths differ: the prefill's request {held.request_id} has "
            f"{held.num_prompt_tokens} tokens, the decode's {reg.num_prompt_tokens}"
        )
    if reg.prompt_digest != held.prompt_digest:
        return (
            f"the prompts of room {held.room} differ in their tokens: do both servers "
            "use the same tokenizer and chat template?"
        )
    return None


def _request_id(entry: _Held | _Send) -> str:
    return entry.request_id if isinstance(entry, _Held) else entry.kv.request_id


def _settled_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


class PrefillConnector(KVConnector):
    """Serves the bootstrap listener on ``host:port`` (0: a free port, see
    ``.port``) from construction. ``num_ranks``: this engine's TP size (a
    decode must register one handshake per rank); ``timeout``: how long a
    finished request waits for its registration, and a registration for its
    request; ``secret``: the worker secret calls must present (None: none)."""

    def __init__(
        self,
        host: str,
        port: int,
        block_size: int,
        num_ranks: int,
        timeout: float = 30.0,
        secret: str | None = None,
    ) -> None:
        if block_size < 1 or num_ranks < 1 or timeout <= 0:
            raise ValueError(
                f"block_size and num_ranks must be >= 1 and timeout > 0, got "
                f"{block_size}, {num_ranks}, {timeout}"
            )
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.timeout = timeout
        self._lock = threading.Lock()
        self._waiting: dict[int, Registration] = {}
        self._held: dict[int, _Held] = {}
        self._by_room: dict[int, _Send] = {}
        self._by_request: dict[str, _Send] = {}
        self._cancels: list[str] = []
        self._freeable: list[str] = []
        self._settled: OrderedDict[int, None] = OrderedDict()
        self.stats = {"sends": 0, "blocks_sent": 0, "sends_failed": 0, "expired": 0}
        self._server = BootstrapServer(self, host, port, secret)
        self.port = self._server.port

    # -- the engine's step thread (KVConnector) --

    def num_remote_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0

    def on_allocated(self, request: Request, block_ids: list[int], num_local_tokens: int) -> None:
        pass

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        params = request.kv_transfer_params
        if params is None or params.role != PREFILL:
            return False
        room, rid = params.room, request.request_id
        with self._lock:
            if request.status not in _OK or not request.output_token_ids:
                reason = request.get_finish_reason() or "no first token"
                self._refuse_room(room, f"prefill request {rid} ended ({reason}) before its KV")
                return False
            occupant = self._held.get(room) or self._by_room.get(room)
            if occupant is not None and _request_id(occupant) == rid:
                return True  # told twice: still held
            if occupant is not None or room in self._settled:
                logger.warning("prefill request %s: room %d already taken; not sent", rid, room)
                return False
            held = _Held(
                rid,
                room,
                list(block_ids),
                request.num_prompt_tokens,
                prompt_digest(request.prompt_token_ids),
                request.output_token_ids[0],
            )
            reg = self._waiting.pop(room, None)
            if reg is None:
                self._held[room] = held
                return True
            return self._match(held, reg)

    def build_metadata(self) -> KVConnectorMetadata | None:
        with self._lock:
            self._expire_held(time.monotonic())
            sends = [s for s in self._by_request.values() if not s.emitted]
            for send in sends:
                send.emitted = True
            cancels, self._cancels = self._cancels, []
            if not (sends or cancels or self._by_request):
                return None
            return KVConnectorMetadata(sends=[s.kv for s in sends], cancels=cancels)

    def on_worker_output(self, finished_sending: set[str], failed_sending: dict[str, str]) -> None:
        with self._lock:
            for rid in (*finished_sending, *failed_sending):
                send = self._by_request.get(rid)
                if send is None or not send.emitted:
                    continue
                if send.cancelled:
                    reply = error_reply("cancelled")
                elif rid in failed_sending:
                    self.stats["sends_failed"] += 1
                    reply = error_reply(f"the prefill's KV send failed: {failed_sending[rid]}")
                else:
                    self.stats["blocks_sent"] += len(send.kv.src_block_ids)
                    reply = done_reply(send.first_token, len(send.kv.src_block_ids))
                    logger.debug(  # the count outside observers (and the tests) read
                        "prefill request %s: KV of room %d sent, %d blocks (%d in all)",
                        rid,
                        send.room,
                        len(send.kv.src_block_ids),
                        self.stats["blocks_sent"],
                    )
                self._end_send(send, reply)

    def take_events(self) -> ConnectorEvents:
        with self._lock:
            self._expire_held(time.monotonic())
            freeable, self._freeable = self._freeable, []
        return ConnectorEvents(freeable=freeable)

    def has_pending(self) -> bool:
        with self._lock:
            return bool(
                self._waiting or self._held or self._by_room or self._cancels or self._freeable
            )

    def shutdown(self) -> None:
        self._server.stop()
        with self._lock:
            for reg in self._waiting.values():
                reg.answer(error_reply("the prefill server is shutting down"))
            self._waiting.clear()

    # -- the listener's handler threads (bootstrap.RegistrationSink) --

    def register(self, reg: Registration) -> None:
        problem = self._check_registration(reg)
        with self._lock:
            if reg.room in self._settled:
                reg.answer(error_reply(f"room {reg.room} was already served, cancelled or expired"))
                return
            if reg.room in self._waiting or reg.room in self._by_room:
                reg.answer(error_reply(f"room {reg.room} is already registered"))
                return
            held = self._held.pop(reg.room, None)
            if problem is not None:  # final for this room: its decode fails the request
                self._settle(reg.room)
                reg.answer(error_reply(problem))
                if held is not None:
                    self._freeable.append(held.request_id)
            elif held is None:
                self._waiting[reg.room] = reg
            elif not self._match(held, reg):
                self._freeable.append(held.request_id)

    def expire(self, reg: Registration) -> None:
        with self._lock:
            if self._waiting.get(reg.room) is reg:
                del self._waiting[reg.room]
                self._settle(reg.room)
                reg.answer(
                    error_reply(
                        f"no prefill request for room {reg.room} finished within "
                        f"{self.timeout:g} s (the prefill's --disaggregation-timeout)"
                    )
                )

    def stream_closed(self, reg: Registration) -> None:
        with self._lock:
            current = self._by_room.get(reg.room)
            if not reg.answered.is_set() and (
                self._waiting.get(reg.room) is reg or (current is not None and current.reg is reg)
            ):
                self._cancel(reg.room)

    def cancel_room(self, room: int) -> threading.Event:
        with self._lock:
            return self._cancel(room)

    def abort_finished(self, request_id: str) -> None:
        # The gateway aborts both halves when its client goes away: a finished
        # request still held for its decode stops waiting (or sending) now.
        with self._lock:
            room = next((r for r, h in self._held.items() if h.request_id == request_id), None)
            send = self._by_request.get(request_id)
            if send is not None:
                room = send.room
            if room is not None:
                self._cancel(room, "aborted on the prefill server")

    # -- helpers (the caller holds the lock) --

    def _cancel(self, room: int, reason: str = "cancelled by the decode") -> threading.Event:
        """The decode of ``room`` gave up (or its prefill request was aborted):
        drop what waits for it, stop its send; the event is set once nothing
        writes into its blocks."""
        self._settle(room)
        reg = self._waiting.pop(room, None)
        if reg is not None:
            reg.answer(error_reply(reason))
        held = self._held.pop(room, None)
        if held is not None:
            self._freeable.append(held.request_id)
        send = self._by_room.get(room)
        if send is None:
            return _settled_event()
        if not send.emitted:
            self._end_send(send, error_reply(reason))
        elif not send.cancelled:
            send.cancelled = True
            self._cancels.append(send.kv.request_id)
        return send.quiet

    def _check_registration(self, reg: Registration) -> str | None:
        """What makes ``reg`` unusable whatever request comes (no lock needed)."""
        if reg.block_size != self.block_size:
            return (
                f"the decode's KV blocks hold {reg.block_size} tokens and this prefill's "
                f"{self.block_size}: give both servers the same --block-size"
            )
        if len(reg.handshakes) != self.num_ranks:
            return (
                f"the decode has {len(reg.handshakes)} TP ranks and this prefill "
                f"{self.num_ranks}: unequal TP sizes are not supported"
            )
        if reg.skip_tokens % self.block_size and reg.skip_tokens != reg.num_prompt_tokens:
            return f"skip_tokens {reg.skip_tokens} is not whole blocks of {self.block_size}"
        wanted = -(-reg.num_prompt_tokens // self.block_size) - reg.skip_tokens // self.block_size
        if len(reg.dst_block_ids) != wanted:
            return (
                f"{len(reg.dst_block_ids)} dst_block_ids for tokens [{reg.skip_tokens}, "
                f"{reg.num_prompt_tokens}) of block size {self.block_size}: expected {wanted}"
            )
        return None

    def _match(self, held: _Held, reg: Registration) -> bool:
        """Pair ``held`` with ``reg``: a pending send (True: hold the blocks),
        or an answer now (False: free them)."""
        first = reg.skip_tokens // self.block_size
        src = held.block_ids[first : first + len(reg.dst_block_ids)]
        problem = _mismatch(held, reg)
        if problem is None and len(src) != len(reg.dst_block_ids):
            problem = f"prefill request {held.request_id} holds too few blocks"
        if problem is not None or not src:  # not src: only the first token travels
            self._settle(held.room)
            reply = done_reply(held.first_token, 0) if problem is None else error_reply(problem)
            reg.answer(reply)
            return False
        kv = KVSend(held.request_id, src, list(reg.dst_block_ids), list(reg.handshakes))
        send = _Send(kv, held.room, reg, held.first_token)
        self._by_room[held.room] = send
        self._by_request[held.request_id] = send
        self.stats["sends"] += 1
        return True

    def _end_send(self, send: _Send, reply) -> None:
        """Nothing writes ``send``'s blocks any more: answer, free, wake Cancel."""
        del self._by_room[send.room]
        del self._by_request[send.kv.request_id]
        self._settle(send.room)
        send.reg.answer(reply)
        self._freeable.append(send.kv.request_id)
        send.quiet.set()

    def _refuse_room(self, room: int, message: str) -> None:
        """The request of ``room`` failed before its KV existed: tell its decode."""
        self._settle(room)
        reg = self._waiting.pop(room, None)
        if reg is not None:
            reg.answer(error_reply(message))

    def _expire_held(self, now: float) -> None:
        for room, held in list(self._held.items()):
            if now - held.finished_at > self.timeout:
                del self._held[room]
                self._settle(room)
                self._freeable.append(held.request_id)
                self.stats["expired"] += 1
                logger.warning(
                    "prefill request %s: no decode registered for room %d within %g s; freed",
                    held.request_id,
                    room,
                    self.timeout,
                )

    def _settle(self, room: int) -> None:
        self._settled[room] = None
        self._settled.move_to_end(room)
        while len(self._settled) > MAX_SETTLED_ROOMS:
            self._settled.popitem(last=False)
