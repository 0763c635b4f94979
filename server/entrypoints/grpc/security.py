"""The public port's optional protections: TLS (mutual with a client CA) and
an API key.

``--api-key KEY``: every call must carry ``authorization: Bearer KEY``
metadata (vLLM's name and header) or is refused with UNAUTHENTICATED, on
its metadata alone (the message is never read, so an unkeyed 60 MB call
costs nothing); the
grpc.health.v1 service stays open so orchestrators can probe without it.
``--tls-cert``/``--tls-key`` serve TLS; ``--tls-client-ca`` also requires
every client to present a certificate that CA signed (mutual TLS).
"""

from __future__ import annotations

import grpc

from tokenbudget.server.entrypoints.grpc.errors import refuse
from tokenbudget.proto.rpc.auth import presents, refusing_handler

# Answered without the API key: a load balancer's probe carries no secrets.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def read_pem(path: str, flag: str) -> bytes:
    """A PEM file's bytes; ValueError naming the flag when it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path} is not a PEM file")
    return data


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None
) -> grpc.ServerCredentials | None:
    """TLS credentials for --tls-cert/--tls-key/--tls-client-ca (None: plaintext).
    Raises ValueError naming the flag that is missing or unreadable."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError(
                "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is "
                "TLS that also checks the client's certificate)"
            )
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together: give both")
    ca = read_pem(client_ca, "--tls-client-ca") if client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, calls (other than health) without the key."""

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._api_key = api_key

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler_call_details.method.startswith(OPEN_SERVICES)
            or presents(handler_call_details.invocation_metadata, self._api_key)
        ):
            return handler

        async def deny(request_iterator, context):  # the message is never read
            # A status and a return: abort's exception would keep the request
            # in a reference cycle (server/entrypoints/grpc/errors.py).
            refuse(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong API key: send metadata "
                "'authorization: Bearer <key>' (the server's --api-key)",
            )

        return refusing_handler(deny)
