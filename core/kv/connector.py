"""The KV connector: KV that a request gets from, or gives to, another
engine (disaggregated prefill/decode), as the scheduler sees it (no torch).

Shaped like vLLM V1's KV connector, in two halves that never meet directly:

* **scheduler side** (``KVConnector``, this module; the engine implements it,
  server/engine/disagg/): how many of a request's tokens arrive remotely,
  what happens once its blocks are allocated, whether freeing a finished
  request's blocks waits for a send, the sends the workers start this step
  (``KVConnectorMetadata`` in the SchedulerOutput), and what the workers
  report back (``finished_sending`` / ``failed_sending`` in the
  ModelRunnerOutput).
* **worker side** (worker/kv_transfer_nixl.py): register the KV cache once
  (its handshake bytes travel in the KVCacheSpec), start the sends a step
  lists, report the finished and failed ones.

A decode-side request that waits for its prompt's KV sits in
``WAITING_FOR_REMOTE_KVS`` holding its blocks; it costs no token budget and
no ``max_num_seqs`` slot, and runs the step after its KV (and the first token
the prefill sampled) arrived.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.request import Request

PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """A request's part in a disaggregated pair: ``role`` prefill (compute the
    prompt, send its KV and first token to the decode that registers under
    ``room``) or decode (register under ``room`` with the prefill's bootstrap
    listener at ``bootstrap_host:bootstrap_port``, receive, then decode)."""

    role: str
    room: int
    bootstrap_host: str = ""
    bootstrap_port: int = 0

    def __post_init__(self) -> None:
        if self.role not in (PREFILL, DECODE):
            raise ValueError(
                f"kv_transfer_params.role must be prefill or decode, not {self.role!r}"
            )


@dataclass(slots=True)
class KVSend:
    """One request's KV to write to a peer: ``src_block_ids`` (this engine's
    blocks, in order) to ``dst_block_ids`` (the peer's), one list per peer
    rank; ``peer_handshakes[r]``: the handshake bytes of the peer's rank r
    (worker/kv_transfer_nixl.py reads them; the scheduler does not)."""

    request_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    peer_handshakes: list[bytes]


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the workers do this step: start ``sends`` (after the KV of every
    earlier step is written), and stop the sends of ``cancels`` (request ids;
    each is reported back as finished or failed once nothing writes any
    more). Sent on every step while the connector ``has_pending`` work, so
    workers report what finished even when no request runs."""

    sends: list[KVSend] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ConnectorEvents:
    """What the connector learnt since the scheduler last asked.

    ``received``: request id -> the first token the prefill sampled (its KV
    is in the blocks allocated for it). ``failed``: request id -> why its
    transfer failed (the request ends with that error). ``freeable``: ids of
    requests finished earlier whose blocks were held (``request_finished``
    returned True) and may now be freed."""

    received: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    freeable: list[str] = field(default_factory=list)


class KVConnector(ABC):
    """The scheduler side of a KV connector. All calls come from the engine's
    step thread; implementations may learn things on other threads and hand
    them over in ``take_events``."""

    @abstractmethod
    def num_remote_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of ``request`` that will arrive from a peer rather than be
        computed here, past its ``num_computed_tokens`` local prefix hits (0:
        compute everything as usual)."""

    @abstractmethod
    def on_allocated(self, request: Request, block_ids: list[int], num_local_tokens: int) -> None:
        """``request``'s blocks for its whole prompt are allocated, the first
        ``num_local_tokens`` tokens already hold local KV; start fetching
        the rest (a decode registers with its prefill)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """``request`` finished (or was aborted) holding ``block_ids``; True
        when its blocks must stay allocated until the connector lists the
        request in ``ConnectorEvents.freeable`` (a send in flight, a send not
        yet started, or a peer that may still write into them)."""

    @abstractmethod
    def build_metadata(self) -> KVConnectorMetadata | None:
        """This step's work for the workers (None: nothing pending)."""

    @abstractmethod
    def on_worker_output(self, finished_sending: set[str], failed_sending: dict[str, str]) -> None:
        """What the workers reported this step."""

    @abstractmethod
    def take_events(self) -> ConnectorEvents:
        """Everything learnt since the last call (then forgotten)."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Whether transfers or held blocks are outstanding (the engine keeps
        stepping, so their completions are noticed)."""

    def abort_finished(self, request_id: str) -> None:
        """A client aborted ``request_id`` after it finished here, while its
        blocks are still held for the connector (a prefill waiting for its
        decode, or sending to it): stop what waits for it and tell the peer;
        the blocks become freeable once nothing reads them. Default: nothing
        to stop."""

    def shutdown(self) -> None:
        """Stop listeners and threads."""
