"""ClientAuth: the TLS and token options of a client, turned into a gRPC channel and call metadata.

auth = ClientAuth.from_args(args)        # --tls-ca, --tls-cert, --tls-key, --token-file
with auth.channel("host:50051") as ch:
    stub.Complete(req, metadata=auth.metadata, timeout=60)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

# A call that waits for its server (wait_for_ready: `pdserve complete --wait`) tries to connect
# again about once a second (at most 1 s between tries, less or more by gRPC's 20% jitter), so it
# starts about a second at most after a server that comes up while it waits: gRPC's own waits
# between tries start at 1 s and grow 1.6 times each try, to 2 minutes (a server up after 30 s
# was answered 15 s later). A caller's own values for these keys come first, and are taken.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ClientAuthError(ValueError):
    """A TLS or token file that cannot be used; the message names the option."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-ca", type=Path, default=None, help="CA certificate (PEM): connect over TLS"
    )
    p.add_argument(
        "--tls-cert", type=Path, default=None, help="client certificate (PEM), for mutual TLS"
    )
    p.add_argument("--tls-key", type=Path, default=None, help="client private key (PEM)")
    p.add_argument(
        "--token-file", type=Path, default=None, help="file holding the server's bearer token"
    )


def read_credential(path: Path, option: str, error: type[ValueError] = ClientAuthError) -> bytes:
    """A certificate, key or token file's bytes; `error` naming `option` when it can't be used
    (the client's and the server's options alike)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise error(f"{option}: {path} is empty")
    return data


def read_token(path: Path, option: str, error: type[ValueError] = ClientAuthError) -> str:
    """A bearer token file's token (surrounding whitespace dropped): visible ASCII only, what an
    HTTP Authorization header and gRPC metadata can carry; `error` naming `option` otherwise."""
    token = read_credential(path, option, error).strip()
    if not all(0x21 <= b <= 0x7E for b in token):
        raise error(
            f"{option}: the token in {path} must be printable ASCII without spaces or control "
            "characters (what an HTTP header and gRPC metadata carry)"
        )
    return token.decode("ascii")


@dataclass(frozen=True, slots=True)
class ClientAuth:
    ca: bytes | None = None  # root certificates: TLS when set
    cert: bytes | None = None  # client certificate chain, for mutual TLS
    key: bytes | None = None
    token: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientAuth:
        """From the options add_arguments defines; raises ClientAuthError naming the option."""
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ClientAuthError("--tls-cert and --tls-key: give both or neither")
        if args.tls_cert is not None and args.tls_ca is None:
            raise ClientAuthError("--tls-cert: mutual TLS needs --tls-ca too")
        token = None
        if args.token_file is not None:
            token = read_token(args.token_file, "--token-file")
        return cls(
            ca=read_credential(args.tls_ca, "--tls-ca") if args.tls_ca else None,
            cert=read_credential(args.tls_cert, "--tls-cert") if args.tls_cert else None,
            key=read_credential(args.tls_key, "--tls-key") if args.tls_key else None,
            token=token,
        )

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def channel(self, address: str, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
        creds = self._credentials()
        options = [*(options or []), *RECONNECT_OPTIONS]  # gRPC takes a key's first value
        if creds is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, creds, options=options)

    def aio_channel(
        self, address: str, options: list[tuple[str, int]] | None = None
    ) -> grpc.aio.Channel:
        creds = self._credentials()
        options = [*(options or []), *RECONNECT_OPTIONS]  # gRPC takes a key's first value
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, creds, options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries: the bearer token, when there is one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()
