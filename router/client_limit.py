"""What clients may hold. --max-streams-per-client: how many requests one client address may
have running at once, over both front doors together (one count per address); past the limit a
request is refused as Overloaded (client_limit). And how many connections each door (the HTTP
port, the gRPC port, the admin port) keeps open at once: `max_connections()`."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable

from router.core_types import Overloaded
from router.stats import StatsSink
from router.vocab import Frontend, RejectReason

RETRY_AFTER_S = 1.0
CONNECTIONS_CAP = 4096  # per door
FILE_LIMIT_WANTED = 65536
log = logging.getLogger("pdserve.server")
# A client that reads none of its answer this long while more waits to go out is cut, on either
# door (router/http_conn.py, router/servicer.py).
SEND_STALL_S = 60.0


def raise_file_limit() -> None:
    """Raise this process's soft file-descriptor limit toward its hard limit (to
    FILE_LIMIT_WANTED at most), as servers do at start: the common soft limit of 1,024 would
    hold each door to 256 connections. Where the system allows less than asked (macOS caps the
    soft limit below an unlimited hard one), the most it allows of halves of it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FILE_LIMIT_WANTED if hard == resource.RLIM_INFINITY else min(hard, FILE_LIMIT_WANTED)
    if soft == resource.RLIM_INFINITY:
        return
    while want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return
        except (ValueError, OSError) as exc:
            if want // 2 <= soft:
                log.warning("could not raise the file limit from %d: %s", soft, exc)
            want //= 2


def max_connections() -> int:
    """Connections one door may hold open at once: CONNECTIONS_CAP, or a quarter of this
    process's file-descriptor limit where that is lower, so that the three doors together
    leave at least a quarter to the metrics port, Ray, the KV transfer and the logs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return CONNECTIONS_CAP
    return max(1, min(CONNECTIONS_CAP, soft // 4))


class ClientLimit:
    def __init__(self, limit: int | None, sink: StatsSink) -> None:
        self.limit = limit
        self.sink = sink
        self._running: dict[str, int] = {}  # requests running per client, while a limit is set

    def take(self, client: str, frontend: Frontend, count: int = 1) -> Callable[[], None]:
        """Count `count` more requests of `client` (a request's choices; Overloaded past the
        limit); call what it returns once, when they end."""
        if self.limit is None:
            return _nothing
        running = self._running.get(client, 0)
        if running + count > self.limit:
            self.sink.rejected(RejectReason.CLIENT_LIMIT, frontend)
            why = f"this client already has {running} requests running"
            if count > 1:
                why += f"; these {count} choices would pass {self.limit}"
            raise Overloaded(
                RejectReason.CLIENT_LIMIT, f"{why} (--max-streams-per-client)", RETRY_AFTER_S
            )
        self._running[client] = self._running.get(client, 0) + count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._running[client] -= count
                if not self._running[client]:
                    del self._running[client]

        return release


def client_host(peer: str) -> str:
    """A caller's address without its port, alike for both doors: gRPC's peer
    ("ipv4:10.0.0.5:51234", "ipv6:[::1]:51234") and HTTP's client host ("10.0.0.5", "::1")."""
    if peer.startswith(("ipv4:", "ipv6:")):
        peer = peer[5:].rsplit(":", 1)[0]
    return peer.removeprefix("[").removesuffix("]")


def _nothing() -> None:
    pass
