"""--max-streams-per-client: how many requests one client address may have running at once, for
every front door alike. Past the limit a request is refused as Overloaded (client_limit)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from router.core_types import Overloaded
from router.stats import StatsSink
from router.vocab import RejectReason

RETRY_AFTER_S = 1.0


class ClientLimit:
    def __init__(self, limit: int | None, sink: StatsSink) -> None:
        self.limit = limit
        self.sink = sink
        self._running: dict[str, int] = {}  # requests running per client, while a limit is set

    @contextlib.contextmanager
    def slot(self, client: str) -> Iterator[None]:
        """One of `client`'s concurrent requests; raises Overloaded past the limit."""
        release = self.take(client)
        try:
            yield
        finally:
            release()

    def take(self, client: str) -> Callable[[], None]:
        """Count one more request of `client` (Overloaded past the limit); call what it returns
        once, when the request ends."""
        if self.limit is None:
            return _nothing
        if self._running.get(client, 0) >= self.limit:
            self.sink.rejected(RejectReason.CLIENT_LIMIT)
            raise Overloaded(
                RejectReason.CLIENT_LIMIT,
                f"this client already has {self.limit} requests running (--max-streams-per-client)",
                RETRY_AFTER_S,
            )
        self._running[client] = self._running.get(client, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._running[client] -= 1
                if not self._running[client]:
                    del self._running[client]

        return release


def _nothing() -> None:
    pass
