"""The server's defenses on a network: TLS (mutual TLS with a client CA), a bearer token checked on
every RPC but the health check, and the refusal a request without the right token gets.

A client sends the token in the `authorization` metadata as `Bearer <token>`; it is compared in
constant time with what the token file holds. A missing or wrong one gets UNAUTHENTICATED, and the
RPC's own handler never runs. The health service stays open, so that load balancers and
Kubernetes probes need no secret; the metrics port is plain HTTP without authentication (keep it
inside the cluster's network, deploy/README.md).
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc

from pdserve_client.connect import read_credential, read_token

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # prefixes of methods that need no token
EXPIRY_WARNING_DAYS = 14  # a server certificate that expires sooner is named at start


class SecurityError(ValueError):
    """A TLS or token file that cannot be used; the message names the option."""


def _named(key: str) -> str:
    """An option as errors name it: its config key and its flag."""
    return f"{key} (--{key.replace('_', '-')})"


_PAIR = "tls_cert and tls_key (--tls-cert, --tls-key)"


def _read(path: Path, option: str) -> bytes:
    return read_credential(path, option, SecurityError)


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    tls_cert: Path | None = None  # the server's certificate chain (PEM)
    tls_key: Path | None = None  # its private key (PEM)
    tls_client_ca: Path | None = None  # clients must present a certificate this CA signed
    auth_token_file: Path | None = None  # the bearer token every RPC but health must carry

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SecurityError(f"{_PAIR}: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SecurityError(f"{_named('tls_client_ca')}: mutual TLS needs {_PAIR}")

    def check(self) -> None:
        """Read every file now, and load the TLS ones as a TLS server would (SecurityError
        naming the option): before anything starts. gRPC would refuse them only as it binds
        its port, once the workers are up, and without saying why."""
        self.server_credentials()
        self.interceptors()
        if self.tls_cert is None or self.tls_key is None:
            return
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # No passphrase prompt for an encrypted key (gRPC cannot use one): refused here.
            ctx.load_cert_chain(self.tls_cert, self.tls_key, password=lambda: b"")
        except ssl.SSLError as exc:
            raise SecurityError(
                f"{_PAIR}: {self.tls_cert} and {self.tls_key} are not a PEM "
                f"certificate chain and its private key ({exc.reason or exc})"
            ) from None
        if self.tls_client_ca is not None:
            try:
                ctx.load_verify_locations(cafile=self.tls_client_ca)
            except ssl.SSLError as exc:
                raise SecurityError(
                    f"{_named('tls_client_ca')}: {self.tls_client_ca} holds no PEM certificate "
                    f"({exc.reason or exc})"
                ) from None

    def date_warnings(self, now: datetime | None = None) -> list[str]:
        """What the certificates' dates say, a line each: one of the server's chain (tls_cert)
        or of the client CAs expired or not yet valid, or the server's own certificate expiring
        within EXPIRY_WARNING_DAYS. gRPC serves such a chain without a word, and its TLS clients
        then refuse every connection."""
        from cryptography import x509

        now = now or datetime.now(UTC)
        out: list[str] = []
        for key, path in (("tls_cert", self.tls_cert), ("tls_client_ca", self.tls_client_ca)):
            if path is None:
                continue
            try:
                certs = x509.load_pem_x509_certificates(_read(path, _named(key)))
            except ValueError:
                continue  # check() says what is wrong with the file
            for i, cert in enumerate(certs):
                try:  # parsed as read: a malformed name or date says nothing here
                    subject = cert.subject.rfc4514_string() or "certificate"
                    after, before = cert.not_valid_after_utc, cert.not_valid_before_utc
                except ValueError:
                    continue
                what = f"{_named(key)}: {path}: {subject}"
                refused = (
                    "TLS clients refuse it" if key == "tls_cert"
                    else "the server refuses the client certificates it signed"
                )  # fmt: skip
                if now > after:
                    out.append(f"{what} expired on {_day(after)}: {refused}")
                elif now < before:
                    out.append(f"{what} is not valid before {_day(before)}: {refused} until then")
                elif key == "tls_cert" and i == 0 and after - now < timedelta(EXPIRY_WARNING_DAYS):
                    days = (after - now).days
                    out.append(f"{what} expires on {_day(after)}, in {days} day(s)")
        return out

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the gRPC ports; None for plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        cert = _read(self.tls_cert, _named("tls_cert"))
        key = _read(self.tls_key, _named("tls_key"))
        ca = _read(self.tls_client_ca, _named("tls_client_ca")) if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def token(self) -> bytes | None:
        """The bearer token requests must carry, or None when none is set."""
        if self.auth_token_file is None:
            return None
        return read_token(self.auth_token_file, _named("auth_token_file"), SecurityError).encode()

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        token = self.token()
        return [] if token is None else [TokenAuth(token)]


def _day(when: datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M UTC")


Behavior = Callable[..., Any]


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every RPC but the open ones whose `authorization` metadata
    is not `Bearer <token>`."""

    def __init__(self, token: bytes) -> None:
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_METHODS):
            return handler
        got = ""
        for key, value in details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == "authorization":
                got = value if isinstance(value, str) else ""
        if bearer_matches(got, self._token):
            return handler  # None, for a method this server lacks: UNIMPLEMENTED
        # Refused before anything else, a method this server lacks too: without the token, a
        # caller cannot tell which services are here (UNIMPLEMENTED would say which are not).
        return _refusal(handler)


def bearer_matches(header: str, token: bytes) -> bool:
    """Whether an Authorization value is `Bearer <token>` (the scheme in any case, as HTTP has
    it), compared in constant time."""
    scheme, _, given = header.partition(" ")
    ok = hmac.compare_digest(given.strip().encode("utf-8", "replace"), token)
    return ok and scheme.lower() == "bearer"


_WHY = "authorization: a valid `Bearer <token>` is required"


async def _refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _WHY)


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _WHY)
    yield  # never reached: makes this an async generator, one shape of a streaming handler


def _refusal(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses at once. For a method that has
    none, one that takes the call's messages as bytes, which it never reads."""
    if handler is None:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream)
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse_unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(_refuse_unary, **kw)
