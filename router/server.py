"""`pdserve serve`: the pools, the request core and the gRPC server, started and stopped in order.

Start: the metrics endpoint, Ray (router/ray_runtime.py) and the worker actors, the tokenizer,
the core (with its load poller), then the gRPC server on host:port with health SERVING, and
the admin service (Scale, ListWorkers) on admin_host:admin_port, and the OpenAI-compatible HTTP
API on host:http_port when it is set. Stop (`stop()`; on SIGINT/SIGTERM: router/serve_signals.py):
health NOT_SERVING, the admin service, no new RPCs or HTTP requests, in-flight requests drained
for up to `drain_timeout_s` (then ended with ShuttingDown, answered UNAVAILABLE or 503 and
aborted on the workers: router/endings.py), the poller, the actors, the metrics endpoint.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from router.admin import add_admin
from router.client_limit import ClientLimit
from router.cluster import Cluster
from router.core import RequestCore
from router.core_types import Backend
from router.grpc_ports import door_options, listen, transport
from router.http_api import HttpApi
from router.http_server import HttpServer
from router.load_poll import slow_step_warning
from router.metrics import Metrics
from router.pools import ENGINES_STOP_S
from router.ray_runtime import init_ray
from router.request import ModelLimits
from router.serve_config import ServeConfig, model_tokenizer
from router.servicer import SERVICE, GenerationServicer, add_services

log = logging.getLogger("pdserve.server")
# Once the requests in flight are ended (at the drain timeout, or interrupted again): how long
# more the front doors wait for their answers to go out before cutting their calls.
END_GRACE_S = 5.0


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
        for line in c.security.date_warnings():
            log.warning("%s", line)
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

        slow = slow_step_warning(infos, c.cluster.worker_hang_timeout_s)
        if slow is not None:
            log.warning("%s", slow)
        self.core = core = RequestCore(backend, infos, c.router, tokenizer, metrics)
        metrics.pending.set_function(lambda: core.pending)  # read at each scrape
        metrics.active.set_function(lambda: core.active)
        await self.core.refresh()
        self.core.start()
        self.grpc = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", 64 << 20), *door_options()],
        )
        # One count of each client's requests over both front doors.
        self.clients = clients = ClientLimit(c.max_streams_per_client, self.core.sink)
        servicer = GenerationServicer(self.core, tokenizer, limits, c.model_name, clients)
        self._health = await add_services(self.grpc, servicer)
        self.port = listen(self.grpc, c.host, c.port, creds, "--port")
        await self.grpc.start()
        if c.admin_port is not None:
            self.admin = grpc.aio.server(
                interceptors=interceptors,
                options=door_options(),
            )
            add_admin(self.admin, self.cluster)
            where = (c.admin_host, c.admin_port)
            self.admin_port = listen(self.admin, *where, creds, "--admin-port")
            await self.admin.start()
            log.info("admin service (operators only) on %s:%d", c.admin_host, self.admin_port)
        if c.http_port is not None:
            api = HttpApi(
                self.core,
                tokenizer,
                limits,
                c.model_name,
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
            transport(c.security),
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
            engines_wait_s = ENGINES_STOP_S
            if self._hurried:  # interrupted again: no worker holds the exit
                log.info("interrupted again: the workers stop without their engines' own stop")
                engines_wait_s = 0.0
            await asyncio.to_thread(self.cluster.shutdown, engines_wait_s)
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
