"""Listening on a port with gRPC, for the worker and the server alike: one
owner per port, and a taken port named as such instead of gRPC's bare
"Failed to bind"."""

from __future__ import annotations

import errno
import socket

import grpc

# gRPC turns SO_REUSEPORT on by default: a second server on a taken port would
# start and split new connections with the first. One owner per port.
NO_PORT_REUSE = ("grpc.so_reuseport", 0)


class BindError(OSError):
    """A server cannot listen on its address; the message names it and the cause."""


def bind_port(
    server: grpc.Server | grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Listen on host:port (0: a free port) with a server built with
    NO_PORT_REUSE, with TLS when ``credentials`` are given; returns the bound
    port. Raises BindError naming the address and, when it can be found, the
    cause ("address already in use")."""
    check_port_free(host, port)  # the cause, without gRPC's own error log line
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_insecure_port(address)
            if credentials is None
            else server.add_secure_port(address, credentials)
        )
    except RuntimeError:  # lost a race for the port; grpc says only "Failed to bind"
        bound = 0
    if bound == 0:
        check_port_free(host, port)
        raise BindError(f"cannot listen on {host}:{port}")
    return bound


def check_port_free(host: str, port: int) -> None:
    """Raise BindError("cannot listen on HOST:PORT: address already in use") when
    a listening socket holds the address. A probe, not a reservation: call it
    before slow start-up work so a taken port fails in a second, not after
    the model has loaded; bind_port stays the authority."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as probe:
            # As gRPC does: a port left in TIME_WAIT by a closed server is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
                raise BindError(f"cannot listen on {host}:{port}: {reason}") from None
