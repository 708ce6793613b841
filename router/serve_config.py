"""What `pdserve serve` runs with (ServeConfig, made by router/effective_options.py), the check
of its hosts and ports before Ray and the workers start, and the served model's tokenizer.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace
from typing import Any

from engine.loader import load_tokenizer
from router.cluster_config import ClusterConfig
from router.core_types import RouterConfig
from router.security import SecurityConfig


@dataclass(frozen=True, slots=True)
class ServeConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see Server.port)
    metrics_port: int | None = 9400  # Prometheus /metrics on `host`; 0: any free port; None: off
    admin_port: int | None = None  # pdserve.v1.Admin on `admin_host`; 0: any port; None: off
    admin_host: str = "127.0.0.1"  # operators only: this machine unless told otherwise
    http_port: int | None = None  # the OpenAI-compatible HTTP API on `host`; 0: any; None: off
    drain_timeout_s: float = 30.0  # in-flight requests on SIGINT/SIGTERM
    security: SecurityConfig = field(default_factory=SecurityConfig)  # both gRPC ports
    max_streams_per_client: int | None = None  # concurrent requests per client address
    max_tokens_limit: int | None = None  # the largest max_tokens a request may ask for
    served_model_name: str | None = None  # the model's name in the APIs; None: cluster.model

    @property
    def model_name(self) -> str:
        """The name the APIs give the model and check requests against."""
        return self.served_model_name or self.cluster.model

    def check_hosts(self, ports_free: bool = True) -> None:
        """ValueError naming the option where `host` or `admin_host` is no address of this
        machine, or (`ports_free`) a port set (not 0) is taken there: found before Ray and the
        workers start, not as the ports bind after them (a restart while the old server still
        drains)."""
        hosts = [("--host", self.host)]
        ports = [("--port", self.host, self.port), ("--metrics-port", self.host, self.metrics_port),
                 ("--http-port", self.host, self.http_port)]  # fmt: skip
        if self.admin_port is not None:
            hosts.append(("--admin-host", self.admin_host))
            ports.append(("--admin-port", self.admin_host, self.admin_port))
        for option, host in hosts:
            try:
                _bind(host, 0)
            except OSError as exc:
                raise ValueError(
                    f"{option}: {host} is not an address of this machine ({exc.strerror or exc})"
                ) from None
        for option, host, port in ports if ports_free else ():
            try:
                if port:  # 0: any free port; None: off
                    _bind(host, port)
            except OSError as exc:
                raise ValueError(
                    f"{option}: {host}:{port} is taken ({exc.strerror or exc}): another server "
                    "there, or one still draining?"
                ) from None


def _bind(host: str, port: int) -> None:
    """Bind a socket to host:port and let it go, as the servers bind theirs (SO_REUSEADDR: a
    port some closed connection still waits on is free to them)."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)


def model_tokenizer(c: ServeConfig) -> Any:
    """The served model's tokenizer, read as the workers read the model (their model config:
    cache folder, seed; under the cluster's model name); ModelNotFoundError where it is not
    there."""
    return load_tokenizer(replace(c.cluster.engine.model, model=c.cluster.model))
