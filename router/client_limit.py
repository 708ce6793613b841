"""--max-streams-per-client: how many requests one client address may have running at once, over
both front doors together (one count per address). Past the limit a request is refused as
Overloaded (client_limit)."""

from __future__ import annotations

from collections.abc import Callable

from router.core_types import Overloaded
from router.stats import StatsSink
from router.vocab import Frontend, RejectReason

RETRY_AFTER_S = 1.0


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
