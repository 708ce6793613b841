"""The server's gRPC ports (the API's and the admin service's): their bounds and their bind. The
HTTP port's bounds: router/http_conn.py.
"""

from __future__ import annotations

import grpc

from router.client_limit import max_connections
from router.security import SecurityConfig

# A connection to a gRPC port must finish its handshake (TLS, HTTP/2's preface) within this long,
# or it is closed: connections that send nothing hold file descriptors the other doors share
# (gRPC's own default waits 120 s).
GRPC_HANDSHAKE_TIMEOUT_S = 10.0


def door_options() -> list[tuple[str, int]]:
    """A gRPC port's bounds: the handshake's deadline, and at most `max_connections()` open at
    once (one past it is closed as it opens)."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", int(GRPC_HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_allowed_incoming_connections", max_connections()),
    ]


def listen(
    server: grpc.aio.Server,
    host: str,
    port: int,
    creds: grpc.ServerCredentials | None,
    option: str,
) -> int:
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_insecure_port(address)
            if creds is None
            else server.add_secure_port(address, creds)
        )
    except RuntimeError:  # newer gRPC raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise OSError(
            f"could not listen on {address} ({option}): is the port taken, or the host not an "
            "address of this machine?"
        )
    return bound


def transport(sec: SecurityConfig) -> str:
    if sec.tls_cert is None:
        return "plaintext"
    return "TLS" if sec.tls_client_ca is None else "mutual TLS"
