"""`pdserve serve`: the pools, the request core and the gRPC server, started and stopped in order.

Start: the metrics endpoint, Ray (router/ray_runtime.py) and the worker actors, the tokenizer,
the core (with its load poller), then the gRPC server on host:port with health SERVING, and
the admin service (Scale, ListWorkers) on admin_host:admin_port, and the OpenAI-compatible HTTP
API on host:http_port when it is set. Stop (SIGINT/SIGTERM, or `stop()`): health NOT_SERVING,
the admin service, no new RPCs or HTTP requests, in-flight requests drained for up to
`drain_timeout_s` (then ended with ShuttingDown, answered UNAVAILABLE or 503 and aborted on the
workers: router/endings.py), the poller, the actors, the metrics endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from engine.loader import load_tokenizer
from router.admin import add_admin
from router.client_limit import ClientLimit, max_connections, raise_file_limit
from router.cluster import Cluster, ClusterConfig
from router.core import RequestCore
from router.core_types import Backend, RouterConfig
from router.http_api import HttpApi
from router.http_server import HttpServer
from router.metrics import Metrics
from router.pools import PoolsUnavailable
from router.ray_runtime import init_ray
from router.request import ModelLimits
from router.security import SecurityConfig
from router.servicer import SERVICE, GenerationServicer, add_services

log = logging.getLogger("pdserve.server")
# Once the requests in flight are ended (at the drain timeout, or interrupted again): how long
# more the front doors wait for their answers to go out before cutting their calls.
END_GRACE_S = 5.0
# A second SIGINT/SIGTERM this soon after the first is the same one passed on, not "again".
AGAIN_AFTER_S = 1.0


# A connection to a gRPC port must finish its handshake (TLS, HTTP/2's preface) within this long,
# or it is closed: connections that send nothing hold file descriptors the other doors share
# (gRPC's own default waits 120 s). The HTTP port's bounds: router/http_conn.py.
GRPC_HANDSHAKE_TIMEOUT_S = 10.0


def _grpc_door_options() -> list[tuple[str, int]]:
    """A gRPC port's bounds: the handshake's deadline, and at most `max_connections()` open at
    once (one past it is closed as it opens)."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", int(GRPC_HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_allowed_incoming_connections", max_connections()),
    ]


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


class Server:
    """One running pdserve server. `backend` replaces the Ray pools (tests, benchmarks)."""

    def __init__(
        self, config: ServeConfig, backend: Backend | None = None, tokenizer: Any = None
    ) -> None:
        self.config = config
        self._backend = backend
        self._tokenizer = tokenizer
        self.cluster: Cluster | None = None
        self.core: RequestCore | None = None
        self.grpc: grpc.aio.Server | None = None
        self.admin: grpc.aio.Server | None = None
        self.port = 0
        self.admin_port = 0
        self.http: HttpServer | None = None
        self.clients: ClientLimit | None = None  # requests per client, over both doors
        self.http_port = 0
        self.metrics: Metrics | None = None
        self.metrics_port = 0
        self._health: Any = None
        self._watch: asyncio.Task[None] | None = None
        # The front doors while stop() drains them, and whether to end their requests now.
        self._draining: tuple[grpc.aio.Server | None, HttpServer | None] = (None, None)
        self._hurried = False
        self._hurrying: list[asyncio.Future[None]] = []  # kept: the loop holds tasks weakly
        self._start_cancelled = False

    def cancel_start(self) -> None:
        """Stop a start still bringing the workers up: start() stops those started and raises
        PoolsUnavailable."""
        self._start_cancelled = True
        if self.cluster is not None:
            self.cluster.cancel_start()

    async def start(self) -> None:
        c = self.config
        # TLS and token files are read first: a bad one stops the start before any worker.
        creds = c.security.server_credentials()
        interceptors = c.security.interceptors()
        # Kept with the endpoint off too: the core reports to it, and its refusal lines are
        # the log's (router/refusal_log.py). Served before the workers start (minutes on a
        # cluster whose nodes are still booting): Prometheus sees the router up meanwhile (no
        # PdserveDown at every start), and a port taken stops the start before any worker.
        self.metrics = metrics = Metrics()
        if c.metrics_port is not None:
            try:
                self.metrics_port = metrics.serve(c.host, c.metrics_port)
            except OSError as exc:
                raise OSError(
                    f"could not listen on {c.host}:{c.metrics_port} (--metrics-port): "
                    f"{exc.strerror or exc}"
                ) from None
            log.info("metrics on http://%s:%d/metrics", c.host, self.metrics_port)
        tokenizer = self._tokenizer
        if tokenizer is None:  # before any worker: a model that is not there stops the start
            tokenizer = await asyncio.to_thread(model_tokenizer, c)
        backend = self._backend
        if backend is None:
            init_ray(c.cluster.address)  # on this thread: Ray sets its signal handlers here
            cluster = self.cluster = await asyncio.to_thread(Cluster, c.cluster, False)
            if self._start_cancelled:  # while it was made: its start stops at once
                cluster.cancel_start()
            try:
                await asyncio.to_thread(cluster.start)  # minutes on a cluster still booting
            except BaseException:
                self.cluster = None  # its start stopped what it started
                raise
            backend = cluster
        infos = await backend.infos()
        limits = ModelLimits(
            vocab_size=infos[0].vocab_size,
            max_model_len=infos[0].max_model_len,
            max_tokens=c.max_tokens_limit,
            kv_blocks=min(i.num_blocks for i in infos),
            block_size=infos[0].block_size,
        )
        held = limits.kv_blocks * limits.block_size
        if held < limits.max_model_len:
            # vLLM refuses to start here; pdserve serves, and says what it means.
            log.warning(
                "a worker's KV cache holds %d tokens, less than the model's context (%d): a "
                "longer prompt is refused, and a request that outgrows the cache alone ends "
                "there (finish_reason length, length_reason kv_cache_capacity)",
                held,
                limits.max_model_len,
            )

        self.core = core = RequestCore(backend, infos, c.router, tokenizer, metrics)
        metrics.pending.set_function(lambda: core.pending)  # read at each scrape
        metrics.active.set_function(lambda: core.active)
        await self.core.refresh()
        self.core.start()
        self.grpc = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", 64 << 20), *_grpc_door_options()],
        )
        # One count of each client's requests over both front doors.
        self.clients = clients = ClientLimit(c.max_streams_per_client, self.core.sink)
        servicer = GenerationServicer(self.core, tokenizer, limits, c.cluster.model, clients)
        self._health = await add_services(self.grpc, servicer)
        self.port = _listen(self.grpc, c.host, c.port, creds, "--port")
        await self.grpc.start()
        if c.admin_port is not None:
            self.admin = grpc.aio.server(
                interceptors=interceptors,
                options=_grpc_door_options(),
            )
            add_admin(self.admin, self.cluster)
            where = (c.admin_host, c.admin_port)
            self.admin_port = _listen(self.admin, *where, creds, "--admin-port")
            await self.admin.start()
            log.info("admin service (operators only) on %s:%d", c.admin_host, self.admin_port)
        if c.http_port is not None:
            api = HttpApi(
                self.core,
                tokenizer,
                limits,
                c.cluster.model,
                c.security.token(),
                clients,
            )
            grace = c.drain_timeout_s + END_GRACE_S  # see stop()
            self.http = HttpServer(api.app, c.host, c.http_port, c.security, grace)
            await self.http.start()
            self.http_port = self.http.port
            log.info(
                "OpenAI-compatible HTTP API on %s://%s:%d/v1",
                "http" if c.security.tls_cert is None else "https",
                c.host,
                self.http_port,
            )
        self._watch = asyncio.ensure_future(self._watch_health(backend))
        both = set(backend.prefill_ids) & set(backend.decode_ids)  # each role once
        log.info(
            "pdserve listening on %s:%d (%s%s; %d prefill, %d decode, %d both workers, policy %s)",
            c.host,
            self.port,
            _transport(c.security),
            ", bearer token" if interceptors else "",
            len(backend.prefill_ids) - len(both),
            len(backend.decode_ids) - len(both),
            len(both),
            c.router.policy.policy.value,
        )

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def _watch_health(self, backend: Backend) -> None:
        """SERVING while a decode worker is up, NOT_SERVING while none is."""
        serving = True
        while True:
            await asyncio.sleep(1.0)
            now = bool(backend.decode_ids)
            if now != serving:
                serving = now
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if now
                    else (health_pb2.HealthCheckResponse.NOT_SERVING)
                )
                for name in ("", SERVICE):
                    await self._health.set(name, status)
                log.warning("health: %s", "SERVING" if now else "NOT_SERVING (no decode worker)")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._health is not None:
            for name in ("", SERVICE):
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self._health.end_watches()  # said NOT_SERVING: they'd hold the drain open
        if self.admin is not None:
            await self.admin.stop(1.0)
            self.admin = None
        # Both front doors take no new request and drain at once. At the drain timeout (at
        # once, hurried) the requests still in flight end with ShuttingDown, which each door
        # answers as a failure (router/endings.py); the doors' own grace is END_GRACE_S more,
        # for those answers to go out.
        grpc_server, http = self._draining = (self.grpc, self.http)
        self.grpc = self.http = None
        drain = 0.0 if self._hurried else self.config.drain_timeout_s
        ending = asyncio.ensure_future(self._end_in_flight(drain))
        if self._hurried:  # interrupted again before the drain began
            self._hurrying.append(asyncio.ensure_future(self._cut(grpc_server, http)))
        stopping = []
        if grpc_server is not None:
            stopping.append(grpc_server.stop(drain + END_GRACE_S))
        if http is not None:
            stopping.append(http.stop())
        await asyncio.gather(*stopping)
        ending.cancel()
        self._draining = (None, None)
        if self.core is not None:
            await self.core.stop()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.shutdown)
            self.cluster = None
        if self.metrics is not None:
            self.metrics.close()

    async def _end_in_flight(self, after_s: float) -> None:
        """Once `after_s` has passed (the front doors not yet closed, or this is cancelled), end
        the requests in flight, and those still to open their streams (ShuttingDown)."""
        if self.core is None:
            return
        await asyncio.sleep(after_s)
        why = (
            "the server is shutting down: interrupted again"
            if self._hurried
            else f"the server is shutting down: its drain timeout ({after_s:g} s) passed"
        )
        if self.cluster is not None and self.core.endings.live:
            self.cluster.closing = True  # their aborts go on without holding their answers
        n = self.core.endings.end_all(why)
        if n:
            log.warning("%s: ended the %d requests still in flight", why.split(": ", 1)[1], n)

    def hurry(self) -> None:
        """The requests in flight end now, not at the drain timeout (each with ShuttingDown,
        which aborts it on its workers): at once while stop() drains, else when it begins. The
        front doors' calls still open END_GRACE_S later are cut."""
        self._hurried = True
        grpc_server, http = self._draining
        if grpc_server is None and http is None:
            return
        self._hurrying.append(asyncio.ensure_future(self._end_in_flight(0.0)))
        self._hurrying.append(asyncio.ensure_future(self._cut(grpc_server, http)))

    async def _cut(self, grpc_server: grpc.aio.Server | None, http: HttpServer | None) -> None:
        await asyncio.sleep(END_GRACE_S)
        if grpc_server is not None:  # a second stop cuts the first one's grace short
            await grpc_server.stop(0)
        if http is not None:
            http.hurry()


def _transport(sec: SecurityConfig) -> str:
    if sec.tls_cert is None:
        return "plaintext"
    return "TLS" if sec.tls_client_ca is None else "mutual TLS"


def _listen(
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


def model_tokenizer(c: ServeConfig) -> Any:
    """The served model's tokenizer, read as the workers read the model (their model config:
    cache folder, seed; under the cluster's model name); ModelNotFoundError where it is not
    there."""
    return load_tokenizer(replace(c.cluster.engine.model, model=c.cluster.model))


async def serve(config: ServeConfig) -> None:
    """Run until SIGINT or SIGTERM, then drain and stop."""
    raise_file_limit()
    # The model first: one that is not there stops the start before Ray and any worker.
    server = Server(config, tokenizer=await asyncio.to_thread(model_tokenizer, config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Ray installs its own SIGTERM handler (exit at once) when it starts: start it first, then
    # take the signals over, so that SIGTERM drains like SIGINT.
    init_ray(config.cluster.address)

    first: list[float] = []  # when the first signal came

    def on_signal() -> None:
        if not stop.is_set():
            first.append(time.monotonic())
            stop.set()
        elif time.monotonic() - first[0] < AGAIN_AFTER_S:
            # The same stop sent twice: a wrapper (`timeout`, a shell script) passing on the
            # Ctrl-C or SIGTERM its process group got too. It drains.
            log.info("a second signal within %.0f s of the first: draining still", AGAIN_AFTER_S)
        else:  # a second one while draining
            log.warning("interrupted again: the requests still in flight end now")
            server.hurry()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a start waits for its workers (up to --start-timeout)
            log.warning("interrupted during the start: stopping the workers started so far")
            server.cancel_start()
            with contextlib.suppress(PoolsUnavailable):
                await starting
        else:
            starting.result()  # what stopped the start, if it did
            await stop.wait()
            log.info(
                "shutting down: draining in-flight requests (up to %.0f s; interrupt again to "
                "end them now)",
                config.drain_timeout_s,
            )
    finally:
        stopping.cancel()
        with contextlib.suppress(Exception):
            await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("stopped")
