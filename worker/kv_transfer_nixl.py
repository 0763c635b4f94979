"""Disaggregated prefill/decode, worker side: this rank's KV cache registered
with NIXL, and the sends a step lists (core/kv/connector.py) written into a
peer engine's blocks.

The prefill side writes (one-sided); the decode side only registers its
cache and hands out its handshake, so it runs no code per transfer. The
handshake is JSON: the NIXL agent metadata (base64) and the cache layout, so a
sender can refuse a peer whose cache differs before it writes a byte.

Every layer's cache is one tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``: block ``b`` of half ``h`` (K or V) is the contiguous bytes at
``base + (h * num_blocks + b) * block_bytes``, so a run of blocks that is
consecutive on both sides is one descriptor per layer and half.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenbudget.core.kv.connector import KVConnectorMetadata, KVSend

logger = logging.getLogger(__name__)

# Handshake fields both caches must agree on for a block-for-block copy.
_MATCHED = ("num_layers", "dtype", "block_size", "num_kv_heads", "head_dim")
# close() waits this long for writes in flight before it aborts them.
_CLOSE_WAIT_S = 5.0


class _Refused(Exception):
    """A send that cannot start; its message is the reason reported for it."""


@dataclass(slots=True)
class _Peer:
    agent: str  # its NIXL agent name
    layout: dict


@dataclass(slots=True)
class _Outcomes:
    """Sends settled since the last poll (each request reported once)."""

    finished: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)


def merge_runs(src: list[int], dst: list[int]) -> np.ndarray:
    """``[R, 3]`` (first src block, first dst block, length) of the maximal
    runs where both block ids are consecutive."""
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate([[True], (np.diff(s) != 1) | (np.diff(d) != 1)]))
    lengths = np.diff(np.append(starts, len(s)))
    return np.stack([s[starts], d[starts], lengths], axis=1)


class KVSendLoop:
    """What every transfer backend does alike: start a step's sends (one
    that cannot start fails with its reason instead of raising), report
    each once it settled, and let writes in flight finish before closing.
    A backend provides ``_start(send)`` (raising _Refused), ``_settle(rid)``
    (moving a settled send from ``_inflight`` to ``_outcomes``) and the two
    attributes."""

    _inflight: dict
    _outcomes: _Outcomes

    def _start(self, send: KVSend) -> None:
        raise NotImplementedError

    def _settle(self, rid: str) -> None:
        raise NotImplementedError

    def _start_all(self, sends: list[KVSend]) -> None:
        for send in sends:
            try:
                self._start(send)
            except _Refused as exc:
                self._outcomes.failed[send.request_id] = str(exc)

    def poll(self) -> tuple[set[str], dict[str, str]]:
        """Sends that settled since the last poll: (finished, failed: id -> why).
        Either way nothing writes their blocks any more."""
        for rid in list(self._inflight):
            self._settle(rid)
        out, self._outcomes = self._outcomes, _Outcomes()
        return out.finished, out.failed

    def _wait_for_writes(self) -> None:
        """Give writes in flight a few seconds to finish (before closing)."""
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while self._inflight and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.001)


class NixlKVTransfer(KVSendLoop):
    """This rank's KV cache, registered once; ``start`` writes a step's sends
    to peers (rank r to the peer's rank r), ``poll`` says which settled."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        rank: int,
        block_size: int,
        agent_name: str | None = None,
    ) -> None:
        # Layers may share one tensor (KV sharing): register and send it once.
        tensors = list({t.data_ptr(): t for t in kv_caches}.values())
        if not tensors:
            raise ValueError("NIXL KV transfer needs a KV cache, got no layers")
        first = tensors[0]
        for t in tensors:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("NIXL KV transfer needs every layer's KV tensor alike")
            if not t.is_contiguous():
                raise ValueError("NIXL KV transfer needs contiguous KV tensors")
        _, num_blocks, bs, num_kv_heads, head_dim = first.shape
        if bs != block_size:
            raise ValueError(f"block_size={block_size} but the KV cache has blocks of {bs}")
        self.device = first.device
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.rank = rank
        self.name = agent_name or (
            f"tokenbudget-{socket.gethostname()}-{os.getpid()}-r{rank}-{uuid.uuid4().hex[:8]}"
        )
        self.layout = {
            "rank": rank,
            "num_layers": len(tensors),
            "base_addrs": [t.data_ptr() for t in tensors],
            "num_blocks": num_blocks,
            "block_bytes": first[0, 0].numel() * first.element_size(),
            "dtype": str(first.dtype).removeprefix("torch."),
            "block_size": bs,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "mem_type": self.mem_type,
            "device_id": first.device.index or 0,
        }
        # UCX's InfiniBand module loads the system's libibverbs, which brings
        # the system's libnl-route-3 beside the copy nixl-cu12 bundles: the
        # two crash the process at exit (SIGSEGV in rtnl_tc_unregister).
        # Without InfiniBand devices nothing is lost by not loading it.
        if not os.path.isdir("/sys/class/infiniband"):
            os.environ.setdefault("UCX_MODULES", "^ib")
        nixl_agent, nixl_agent_config = _nixl_api()
        # No listener thread: metadata travels in the handshake bytes.
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._tensors = tensors  # registered memory must outlive the registration
        self._registered = self.agent.register_memory(tensors)
        self._peers: dict[bytes, _Peer] = {}  # handshake bytes -> peer
        self._remote_agents: set[str] = set()
        self._inflight: dict[str, object] = {}  # request id -> nixl_xfer_handle
        self._outcomes = _Outcomes()
        # Descriptors issued (one per layer, K/V half and block run), for tests.
        self.num_descriptors = 0

    def handshake(self) -> bytes:
        """What a peer needs to write into this cache (KVCacheSpec carries it)."""
        meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        info = {"backend": "nixl", "agent": self.name, "metadata": meta, **self.layout}
        return json.dumps(info).encode()

    # -- step -------------------------------------------------------------------
    def start(self, meta: KVConnectorMetadata) -> None:
        """Start ``meta.sends``; a send that cannot start fails (reported by
        the next ``poll``) rather than raising.

        ``meta.cancels`` need nothing here: every send starts at once, and a
        write in flight is left to finish. NIXL's abort (releasing the handle)
        cancels the UCX requests without fencing bytes already on the wire, so
        an aborted send could still land in blocks the peer has reused; a
        cancelled send is reported, like any other, once it settled."""
        if meta.sends and self.device.type == "cuda":
            # The forward that wrote these blocks may still be running.
            torch.cuda.current_stream(self.device).synchronize()
        self._start_all(meta.sends)

    def close(self) -> None:
        """Deregister the cache (idempotent); writes in flight get a few
        seconds to finish first, then are aborted."""
        self._wait_for_writes()
        for handle in self._inflight.values():
            try:
                handle.release()
            except Exception as exc:  # the agent goes away next regardless
                logger.warning("NIXL: could not abort a KV send at shutdown: %s", exc)
        self._inflight.clear()
        if self._registered is not None:
            for agent in self._remote_agents:
                self.agent.remove_remote_agent(agent)
            self.agent.deregister_memory(self._registered)
            self._registered = None
            self._tensors = []
            self._remote_agents.clear()
            self._peers.clear()

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
        local, remote = self._descriptors(send, peer.layout)
        self.num_descriptors += len(local)
        try:
            local_descs = self.agent.get_xfer_descs(local, self.mem_type)
            remote_descs = self.agent.get_xfer_descs(remote, peer.layout["mem_type"])
            handle = self.agent.initialize_xfer("WRITE", local_descs, remote_descs, peer.agent)
            state = self.agent.transfer(handle)
        except Exception as exc:  # nixl raises its own types; the send alone fails
            raise _Refused(f"NIXL could not start the KV write: {exc}") from exc
        self._inflight[rid] = handle
        if state != "PROC":
            self._settle(rid)

    def _peer(self, handshakes: list[bytes]) -> _Peer:
        """The peer rank this rank writes to (same rank), added to the agent once."""
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
            backend = info.get("backend", "nixl") if isinstance(info, dict) else "nixl"
            if backend != "nixl":
                raise _Refused(
                    f"the peer moves KV with {backend}, this engine with nixl: both need the "
                    "same --disaggregation-transfer-backend"
                )
            layout = {k: info[k] for k in self.layout}
            name, metadata = info["agent"], base64.b64decode(info["metadata"])
        except (ValueError, KeyError, TypeError) as exc:
            raise _Refused(f"the peer's KV handshake is not valid: {exc!r}") from exc
        for key in _MATCHED:
            if layout[key] != self.layout[key]:
                raise _Refused(
                    f"KV layout mismatch with the peer: {key} is {self.layout[key]} here, "
                    f"{layout[key]} there"
                )
        if layout["rank"] != self.rank:
            raise _Refused(f"the peer handshake is rank {layout['rank']}'s, not {self.rank}'s")
        if name not in self._remote_agents:
            try:
                self.agent.add_remote_agent(metadata)
            except Exception as exc:
                raise _Refused(f"NIXL could not add the peer agent {name}: {exc}") from exc
            self._remote_agents.add(name)
        peer = self._peers[raw] = _Peer(name, layout)
        return peer

    def _descriptors(self, send: KVSend, peer: dict) -> tuple[np.ndarray, np.ndarray]:
        """``[N, 3]`` (address, length, device) descriptors, local and remote,
        per layer, K/V half and run of blocks."""
        for side, ids, n in (
            ("source", send.src_block_ids, self.layout["num_blocks"]),
            ("destination", send.dst_block_ids, peer["num_blocks"]),
        ):
            if min(ids) < 0 or max(ids) >= n:
                raise _Refused(f"KV send {side} block ids must be in [0, {n}), got {ids}")
        runs = merge_runs(send.src_block_ids, send.dst_block_ids)
        nbytes = self.layout["block_bytes"]
        lengths = runs[:, 2] * nbytes
        return (
            _descs(self.layout, runs[:, 0], lengths, nbytes),
            _descs(peer, runs[:, 1], lengths, nbytes),
        )

    def _settle(self, rid: str) -> None:
        """Report ``rid`` once its write is over (done or failed)."""
        handle = self._inflight[rid]
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as exc:
            logger.warning("NIXL: KV send %s state unknown: %s", rid, exc)
            state = "ERR"
        if state == "PROC":
            return
        del self._inflight[rid]
        try:
            handle.release()
        except Exception as exc:  # settled either way: nothing writes any more
            logger.warning("NIXL: KV send %s handle not released: %s", rid, exc)
        if state == "DONE":
            self._outcomes.finished.add(rid)
        else:
            self._outcomes.failed[rid] = "NIXL failed to write the KV to the peer"


def _nixl_api():
    """NIXL's agent classes: an optional dependency, only disaggregation needs it.
    The ``nixl`` package picks the build for the local CUDA; without it, nixl-cu12."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise ImportError(
                "disaggregated prefill/decode needs NIXL: pip install nixl-cu12 "
                "(and pip install --no-deps nixl)"
            ) from exc
    return nixl_agent, nixl_agent_config


def _descs(layout: dict, first_ids: np.ndarray, lengths: np.ndarray, nbytes: int) -> np.ndarray:
    """Descriptors of runs starting at ``first_ids`` in every layer and K/V
    half of the cache ``layout`` describes."""
    bases = np.asarray(layout["base_addrs"], dtype=np.uint64)
    half = np.arange(2, dtype=np.uint64) * np.uint64(layout["num_blocks"] * nbytes)
    offsets = first_ids.astype(np.uint64) * np.uint64(nbytes)
    addrs = bases[:, None, None] + half[None, :, None] + offsets[None, None, :]
    n = addrs.size
    out = np.empty((n, 3), dtype=np.uint64)
    out[:, 0] = addrs.reshape(-1)
    out[:, 1] = np.tile(lengths.astype(np.uint64), n // len(lengths))
    out[:, 2] = layout["device_id"]
    return out
