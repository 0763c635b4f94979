"""Chained hashes over full blocks of tokens.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys). Extra keys
make two blocks with equal tokens differ when what they encode differs: the
multimodal items overlapping the block (an image placeholder is the same pad
token whatever the image), the LoRA adapter, and a cache salt (first block
only, so salting isolates a whole chain).

The hash must be stable across processes and machines (workers and a future
distributed cache compare them), so the salted builtin ``hash`` is out; and
by default collision resistant: a crafted collision would let one client read
another client's cached KV. xxhash is offered as an opt-in for speed; it is
not collision resistant, so it is seeded (``hash_seed``, else a random seed
drawn once per process) and colliding prompts cannot be computed in advance.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tokenbudget.core.request import Request


# xxhash's seed when none is configured: one per process, unknown to clients.
_PROCESS_SEED = secrets.randbits(64)


def _hash_fn(algo: str, seed: int | None = None) -> Callable[[bytes], bytes]:
    if algo == "sha256":
        sha256 = hashlib.sha256
        return lambda data: sha256(data).digest()
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ValueError(
                "hash_algo='xxhash' needs the xxhash package (pip install 'tokenbudget[fast-hash]')"
            ) from e
        xxh3 = xxhash.xxh3_128_digest
        seed = _PROCESS_SEED if seed is None else seed
        return lambda data: xxh3(data, seed)
    raise ValueError(f"unknown hash_algo {algo!r}")


class BlockHasher:
    """Extends ``request.block_hashes`` over the request's new full blocks."""

    __slots__ = ("block_size", "_hash")

    def __init__(self, block_size: int, algo: str = "sha256", seed: int | None = None) -> None:
        """``seed``: xxhash's (None: this process's random seed); sha256 has none."""
        self.block_size = block_size
        self._hash = _hash_fn(algo, seed)

    def update(self, request: Request) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        start = len(hashes) * bs
        num_full = (len(tokens) - start) // bs
        if num_full <= 0:
            return hashes
        parent = hashes[-1] if hashes else b""
        # One conversion for all new blocks, then byte slices per block.
        data = array("q", tokens[start : start + num_full * bs]).tobytes()
        stride = bs * 8  # int64 tokens
        plain = (
            not request.mm_features
            and request.lora_id is None
            and (request.cache_salt is None or start > 0)
        )
        h = self._hash
        for k in range(num_full):
            payload = parent + data[k * stride : (k + 1) * stride]
            if not plain:
                payload += self._extra_keys(request, start + k * bs, start + (k + 1) * bs)
            parent = h(payload)
            hashes.append(parent)
        return hashes

    @staticmethod
    def _extra_keys(request: Request, start: int, end: int) -> bytes:
        parts: list[str] = []
        for f in request.mm_features:
            if f.offset >= end:
                break
            if f.offset + f.length > start:
                # The item's position relative to the block is part of the key:
                # the same image shifted by one token is different KV.
                parts.append(f"mm:{f.mm_hash}@{f.offset - start}")
        if request.lora_id is not None:
            parts.append(f"lora:{request.lora_id}")
        if start == 0 and request.cache_salt is not None:
            parts.append(f"salt:{request.cache_salt}")
        return "|".join(parts).encode() if parts else b""
