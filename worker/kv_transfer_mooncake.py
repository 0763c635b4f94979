"""Disaggregated prefill/decode, worker side, with Mooncake's transfer engine
instead of NIXL (``--disaggregation-transfer-backend mooncake``): the same
interface and the same block layout as worker/kv_transfer_nixl.py.

Mooncake runs here over its ``tcp`` protocol with peer-to-peer handshakes (no
metadata server): an engine is reachable at its session id ``host:rpc_port``,
which the handshake carries next to the cache layout. The decode side only
registers its cache; the prefill side writes (one-sided).

Each descriptor (one per layer, K/V half and run of blocks) is submitted as a
batch of its own: Mooncake's non-blocking status check
(``transfer_check_status``) looks at a batch's first task only, and its batch
status call blocks until the whole batch is over (and a batch of 2,048
descriptors failed here where the same writes one batch each succeeded), so
one batch per descriptor is what lets ``poll`` see every write settle without
waiting.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass

import numpy as np
import torch

from tokenbudget.core.kv.connector import KVConnectorMetadata, KVSend
from tokenbudget.worker.kv_transfer_nixl import (
    _MATCHED,
    KVSendLoop,
    _descs,
    _Outcomes,
    _Refused,
    merge_runs,
)

__all__ = ["MooncakeKVTransfer", "merge_runs"]

logger = logging.getLogger(__name__)

BACKEND = "mooncake"
# Mooncake's TCP transport rejects descriptors past this many queued per peer
# (its default is 1024, its maximum 65535; a 256-block scattered send of a
# 28-layer model is 14,336). Set before the engine starts, unless the user set it.
_MAX_QUEUED_PER_PEER = "65535"


@dataclass(slots=True)
class _Write:
    """A send in flight: its descriptors' batch ids not yet settled, and why
    it failed once any descriptor did (reported when all settled)."""

    pending: list[int]
    error: str = ""


class MooncakeKVTransfer(KVSendLoop):
    """This rank's KV cache, registered once with a Mooncake transfer engine;
    ``start`` writes a step's sends to peers (rank r to the peer's rank r),
    ``poll`` says which settled. ``hostname``: the address peers reach this
    engine at (default: this host's outbound address)."""

    def __init__(
        self, kv_caches: list[torch.Tensor], rank: int, block_size: int, hostname: str | None = None
    ) -> None:
        tensors, self.layout = _cache_layout(kv_caches, rank, block_size)
        self.rank = rank
        transfer_engine = _mooncake_api()
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", _MAX_QUEUED_PER_PEER)
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines on every start
        host = hostname or _outbound_address()
        self.engine = transfer_engine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._peers: dict[bytes, dict] = {}  # handshake bytes -> the peer's handshake
        self._inflight: dict[str, _Write] = {}
        self._outcomes = _Outcomes()
        # Descriptors issued (one per layer, K/V half and block run), for tests.
        self.num_descriptors = 0
        self._tensors: list[torch.Tensor] = []  # registered memory outlives its registration
        for t in tensors:
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                self.close()
                raise RuntimeError("Mooncake could not register the KV cache")
            self._tensors.append(t)

    def handshake(self) -> bytes:
        """What a peer needs to write into this cache (KVCacheSpec carries it)."""
        return json.dumps({"backend": BACKEND, "session": self.session, **self.layout}).encode()

    # -- step -------------------------------------------------------------------
    def start(self, meta: KVConnectorMetadata) -> None:
        """Start ``meta.sends``; a send that cannot start fails (reported by
        the next ``poll``) rather than raising.

        ``meta.cancels`` need nothing here: every send starts at once, and
        Mooncake has no way to abort a write in flight, so it is left to
        finish; a cancelled send is reported, like any other, once it settled."""
        self._start_all(meta.sends)

    def close(self) -> None:
        """Deregister the cache and stop the engine (idempotent); writes in
        flight get a few seconds to finish first."""
        self._wait_for_writes()
        if self._inflight:
            logger.warning("Mooncake: %d KV sends still writing at shutdown", len(self._inflight))
            self._inflight.clear()
        if self.engine is None:
            return
        for t in self._tensors:
            if self.engine.unregister_memory(t.data_ptr()) != 0:
                logger.warning("Mooncake: could not deregister a KV tensor at shutdown")
        self._tensors = []
        self._peers.clear()
        self.engine = None  # its destructor closes the listener and connections

    # -- internals ----------------------------------------------------------------
    def _start(self, send: KVSend) -> None:
        rid = send.request_id
        # The connector sends a request's KV once; a second send could only be
        # reported while the first still writes.
        assert rid not in self._inflight, f"KV send {rid} started twice"
        if len(send.src_block_ids) != len(send.dst_block_ids):
            raise _Refused(
                f"KV send has {len(send.src_block_ids)} source blocks but "
                f"{len(send.dst_block_ids)} destination blocks"
            )
        if not send.src_block_ids:
            self._outcomes.finished.add(rid)  # nothing to write (all prefix hits)
            return
        peer = self._peer(send.peer_handshakes)
        local, remote, lengths = self._descriptors(send, peer)
        self.num_descriptors += len(local)
        write = _Write([])
        for src, dst, n in zip(local.tolist(), remote.tolist(), lengths.tolist()):
            batch = self.engine.transfer_submit_write(peer["session"], src, dst, n)
            if batch <= 0:  # the descriptors already submitted still write
                write.error = f"Mooncake could not start the KV write to {peer['session']}"
                break
            write.pending.append(batch)
        if not write.pending:
            raise _Refused(write.error)
        self._inflight[rid] = write
        self._settle(rid)

    def _peer(self, handshakes: list[bytes]) -> dict:
        """The handshake of the peer rank this rank writes to (same rank)."""
        if len(handshakes) <= self.rank:
            raise _Refused(
                f"the peer engine has {len(handshakes)} ranks, this is rank {self.rank}: "
                "prefill and decode need equal tensor-parallel sizes"
            )
        raw = handshakes[self.rank]
        peer = self._peers.get(raw)
        if peer is not None:
            return peer
        try:
            info = json.loads(raw)
            backend = info.get("backend", "nixl")  # NIXL's handshake names no backend
            if backend != BACKEND:
                raise _Refused(
                    f"the peer moves KV with {backend}, this engine with {BACKEND}: "
                    "both need the same --disaggregation-transfer-backend"
                )
            peer = {k: info[k] for k in (*self.layout, "session")}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _Refused(f"the peer's KV handshake is not valid: {exc!r}") from exc
        for key in _MATCHED:
            if peer[key] != self.layout[key]:
                raise _Refused(
                    f"KV layout mismatch with the peer: {key} is {self.layout[key]} here, "
                    f"{peer[key]} there"
                )
        if peer["rank"] != self.rank:
            raise _Refused(f"the peer handshake is rank {peer['rank']}'s, not {self.rank}'s")
        self._peers[raw] = peer
        return peer

    def _descriptors(self, send: KVSend, peer: dict) -> tuple[np.ndarray, ...]:
        """Local addresses, remote addresses and lengths, per layer, K/V half
        and run of blocks."""
        for side, ids, n in (
            ("source", send.src_block_ids, self.layout["num_blocks"]),
            ("destination", send.dst_block_ids, peer["num_blocks"]),
        ):
            if min(ids) < 0 or max(ids) >= n:
                raise _Refused(f"KV send {side} block ids must be in [0, {n}), got {ids}")
        runs = merge_runs(send.src_block_ids, send.dst_block_ids)
        nbytes = self.layout["block_bytes"]
        local = _descs(self.layout, runs[:, 0], runs[:, 2] * nbytes, nbytes)
        remote = _descs(peer, runs[:, 1], runs[:, 2] * nbytes, nbytes)
        return local[:, 0], remote[:, 0], local[:, 1]

    def _settle(self, rid: str) -> None:
        """Report ``rid`` once every descriptor's write is over (done or failed)."""
        write = self._inflight[rid]
        # Descriptors to one peer complete about in order: checking up to the
        # first one still writing keeps a poll's cost to what settled since.
        done = 0
        for batch in write.pending:
            state = self.engine.transfer_check_status(batch)  # frees the batch once over
            if state == 0:
                break
            done += 1
            if state != 1 and not write.error:
                write.error = (
                    "Mooncake timed out writing the KV to the peer"
                    if state == -2
                    else "Mooncake failed to write the KV to the peer"
                )
        del write.pending[:done]
        if write.pending:
            return
        del self._inflight[rid]
        if write.error:
            self._outcomes.failed[rid] = write.error
        else:
            self._outcomes.finished.add(rid)


def _cache_layout(
    kv_caches: list[torch.Tensor], rank: int, block_size: int
) -> tuple[list[torch.Tensor], dict]:
    """The distinct layer tensors (layers may share one) and the layout a
    peer checks, with the same fields as NIXL's handshake."""
    tensors = list({t.data_ptr(): t for t in kv_caches}.values())
    if not tensors:
        raise ValueError("Mooncake KV transfer needs a KV cache, got no layers")
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("Mooncake KV transfer needs every layer's KV tensor alike")
        if not t.is_contiguous():
            raise ValueError("Mooncake KV transfer needs contiguous KV tensors")
    if first.device.type != "cpu":
        raise ValueError(
            f"Mooncake KV transfer (mooncake-transfer-engine-non-cuda, tcp) moves host memory "
            f"only, the KV cache is on {first.device}: use --disaggregation-transfer-backend nixl"
        )
    _, num_blocks, bs, num_kv_heads, head_dim = first.shape
    if bs != block_size:
        raise ValueError(f"block_size={block_size} but the KV cache has blocks of {bs}")
    return tensors, {
        "rank": rank,
        "num_layers": len(tensors),
        "base_addrs": [t.data_ptr() for t in tensors],
        "num_blocks": num_blocks,
        "block_bytes": first[0, 0].numel() * first.element_size(),
        "dtype": str(first.dtype).removeprefix("torch."),
        "block_size": bs,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "mem_type": "DRAM",
        "device_id": 0,
    }


def _mooncake_api():
    """Mooncake's TransferEngine: an optional dependency that only this
    backend needs; its wheel loads the system's libibverbs."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            "--disaggregation-transfer-backend mooncake needs Mooncake: pip install "
            "mooncake-transfer-engine-non-cuda (and libibverbs1 from the system, "
            f"e.g. apt-get install libibverbs1): {exc}"
        ) from exc
    return TransferEngine


def _outbound_address() -> str:
    """This host's address on its default route (a UDP connect sends nothing),
    or loopback on a host without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
