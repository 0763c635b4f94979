"""The rendezvous store of a tensor-parallel group, bound to the host it names.

torch.distributed's ``tcp://HOST:PORT`` init method starts rank 0's TCPStore
listening on every interface (``*:PORT``) whatever HOST says: an
unauthenticated key-value store anyone on the network could write into. Rank
0 here binds the listening socket itself, on HOST's address, and hands it to
the store (``master_listen_fd``); the other ranks connect to HOST as before.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

import torch.distributed as dist


def parse_tcp_init(init_method: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://HOST:PORT`` init method; None for other schemes."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp":
        return None
    if not parts.hostname or parts.port is None:
        raise ValueError(f"--dist-init must be tcp://HOST:PORT, got {init_method!r}")
    return parts.hostname, parts.port


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``'s address only (its first resolution)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def bound_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """Rank 0: the store served on a socket bound to ``host`` (the store owns
    the socket from then on). Other ranks: a client of it."""
    listen_fd = _listen(host, port).detach() if rank == 0 else None
    return dist.TCPStore(
        host,
        port,
        world_size,
        rank == 0,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )
