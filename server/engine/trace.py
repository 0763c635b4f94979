"""Workload traces recorded from a live engine: what arrived when, how long
its prompt and output were, and which prefixes it shared (short hashes of the
prompt's full blocks; no token ids, no text). The simulator (server/sim)
replays them: identical recorded hashes become identical synthetic blocks, so
the replay shares exactly what the recording shared.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.request import Request

TRACE_FORMAT = "tokenbudget-trace"


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    # A prefix shared with other requests: ``prefix_len`` tokens of prefix
    # ``prefix_id`` (a system prompt), or a session's history (multi-turn).
    prefix_id: int = -1
    prefix_len: int = 0
    session: int = -1
    # Replay: recorded hashes of the prompt's full blocks (hex).
    block_hashes: tuple[str, ...] = ()
    tenant: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None


class TraceRecorder:
    """Records requests as the engine sees them: arrival time, prompt length,
    the hashes of the prompt's full blocks (short hex; no token ids, no text),
    tenant and SLO targets, and the output length once finished.

    Call ``on_add(request)`` after the scheduler accepted it (its block hashes
    are computed then) and ``on_finish(request_id, num_output_tokens)``."""

    def __init__(self, block_size: int, hash_hex_chars: int = 16) -> None:
        self.block_size = block_size
        self.hex_chars = hash_hex_chars
        self.requests: dict[str, TraceRequest] = {}
        self._t0: float | None = None

    def on_add(self, request: Request) -> None:
        if self._t0 is None:
            self._t0 = request.arrival_time
        full = request.num_prompt_tokens // self.block_size
        hashes = tuple(h.hex()[: self.hex_chars] for h in request.block_hashes[:full])
        self.requests[request.request_id] = TraceRequest(
            request.arrival_time - self._t0,
            request.num_prompt_tokens,
            0,
            block_hashes=hashes,
            tenant=request.tenant,
            ttft_ms=request.ttft_ms,
            tpot_ms=request.tpot_ms,
        )

    def on_finish(self, request_id: str, num_output_tokens: int) -> None:
        rec = self.requests.get(request_id)
        if rec is not None:
            rec.output_len = num_output_tokens

    def save(self, path: str | Path) -> None:
        """JSON lines: a header, then one request per line, in arrival order."""
        recs = sorted(self.requests.values(), key=lambda r: r.arrival_s)
        with open(path, "w") as f:
            f.write(
                json.dumps({"format": TRACE_FORMAT, "version": 1, "block_size": self.block_size})
                + "\n"
            )
            for r in recs:
                if r.output_len:  # finished requests only: an aborted one has no length
                    f.write(json.dumps(_compact(r)) + "\n")


def _compact(r: TraceRequest) -> dict:
    """The fields that differ from their defaults (and the three required ones)."""
    out = {}
    for f in fields(TraceRequest):
        v = getattr(r, f.name)
        if f.default is MISSING or v != f.default:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def load_trace(path: str | Path) -> tuple[list[TraceRequest], int]:
    """A recorded trace and the block size its hashes are over."""
    with open(path) as f:
        header = json.loads(f.readline())
        if header.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} file")
        out = []
        for line in f:
            d = json.loads(line)
            d["block_hashes"] = tuple(d.get("block_hashes", ()))
            out.append(TraceRequest(**d))
    return out, int(header["block_size"])
