"""uvicorn serving the HTTP API on the server's own event loop (the request core lives there),
with the same TLS files as the gRPC ports. Started and stopped by router/server.py; the server's
SIGINT/SIGTERM handling stays the server's (uvicorn's own is not installed)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import uvicorn

from router.http_conn import BoundedH11Protocol
from router.security import SecurityConfig


class HttpServer:
    def __init__(
        self, app: Any, host: str, port: int, security: SecurityConfig, grace_s: float
    ) -> None:
        sec = security
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="off",
            http=BoundedH11Protocol,  # idle and slow connections closed, their number bounded
            # The client is the socket's peer: a header (X-Forwarded-For) names no other, so
            # --max-streams-per-client cannot be dodged by sending one.
            proxy_headers=False,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=max(1, round(grace_s)),
            ssl_certfile=str(sec.tls_cert) if sec.tls_cert else None,
            ssl_keyfile=str(sec.tls_key) if sec.tls_key else None,
            ssl_ca_certs=str(sec.tls_client_ca) if sec.tls_client_ca else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if sec.tls_client_ca else ssl.CERT_NONE,
        )
        self.server = uvicorn.Server(self.config)
        self.port = 0
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if not self.config.loaded:
            self.config.load()
        # What uvicorn.Server.serve does before startup, without taking over the signals.
        self.server.lifespan = self.config.lifespan_class(self.config)
        try:
            await self.server.startup()
        except SystemExit:  # uvicorn's answer to a port it cannot bind (it logs the reason)
            raise OSError(
                f"could not listen on {self.config.host}:{self.config.port} (--http-port)"
            ) from None
        if self.server.should_exit:  # it logged why
            raise OSError(
                f"could not listen on {self.config.host}:{self.config.port} (--http-port)"
            )
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self._loop = asyncio.ensure_future(self.server.main_loop())

    async def stop(self) -> None:
        """No new connections; requests in flight get the grace this server was given (the
        server's drain timeout and END_GRACE_S: router/server.py ends them before it), then
        are cancelled (which aborts them on their workers)."""
        self.server.should_exit = True
        if self._loop is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None
        await self.server.shutdown()

    def hurry(self) -> None:
        """While stop() drains: cancel the requests still in flight now, as uvicorn does when
        its graceful shutdown times out (cancelling a request's task closes its stream, which
        aborts it on its workers). The server calls it END_GRACE_S after ending them."""
        self.server.force_exit = True
        for task in list(self.server.server_state.tasks):
            task.cancel()
