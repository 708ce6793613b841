"""The KV pairs between workers (a prefill-capable one and a decode-capable one): which are
connected, which are broken, and when a broken one is tried again.

A pair is one connection whichever way its transfers go (a worker that both prefills and decodes
sends KV to a peer of its kind and receives from it over the same pair): (a, b) and (b, a) name
the same pair; `connect` is called with its two ids in the order the first call named them.

A pair is made once, when both of its workers are up (before a new worker takes load), and
requests never wait for one: a request whose pair is not connected prefills on its decode worker
at once (a fallback, counted). So a pair that cannot connect (a firewall, a wrong interface)
costs one bounded wait, at the start, not one per request.

A pair in state:
  CONNECTING  an attempt runs (bounded by `timeout_s`);
  CONNECTED   transfers may use it;
  BROKEN      the last attempt failed, or a transfer found it lost; it is tried again in the
              background after a backoff that doubles with each failed attempt (up to
              `max_backoff_s`), then resets once it connects.
Every attempt and every state change runs on one event loop (the cluster's supervisor loop);
other threads only read `connected()`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.workers import within

log = logging.getLogger("pdserve.pairing")

Connect = Callable[[str, str], Awaitable[None]]  # (worker id, worker id): make the pair


def pair_key(a: str, b: str) -> tuple[str, str]:
    """The one key of the pair of `a` and `b`, whichever order they come in."""
    return (a, b) if a <= b else (b, a)


class PairStatus(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    BROKEN = "broken"


@dataclass(slots=True)
class PairState:
    status: PairStatus
    ends: tuple[str, str]  # the two workers, as the first call named them
    failures: int = 0  # failed attempts since it last connected
    retry_at: float = 0.0  # time.monotonic() of the next background attempt (BROKEN)
    error: str = ""  # why the last attempt failed or the pair was lost
    task: asyncio.Task[None] | None = None


class PairBook:
    def __init__(
        self,
        connect: Connect,
        timeout_s: float = 10.0,
        backoff_s: float = 5.0,
        max_backoff_s: float = 120.0,
    ) -> None:
        self._connect = connect
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._pairs: dict[tuple[str, str], PairState] = {}

    # -- reading (any thread) --------------------------------------------------------------------
    def connected(self, p: str, d: str) -> bool:
        st = self._pairs.get(pair_key(p, d))
        return st is not None and st.status is PairStatus.CONNECTED

    def state(self, p: str, d: str) -> PairState | None:
        return self._pairs.get(pair_key(p, d))

    def why_not(self, p: str, d: str) -> str:
        """Why (p, d) cannot carry a transfer now, in words."""
        st = self._pairs.get(pair_key(p, d))
        if st is None:
            return f"{p} and {d} have not been paired"
        if st.status is PairStatus.CONNECTING:
            return f"pairing {p} -> {d} is in progress"
        wait = max(0.0, st.retry_at - time.monotonic())
        return f"pair {p} -> {d} is broken ({st.error}); next attempt in {wait:.0f} s"

    # -- changing (the supervisor loop) ----------------------------------------------------------
    async def pair(self, p: str, d: str) -> bool:
        """Make (p, d) now, or join the attempt under way; bounded by `timeout_s`. True when it
        is connected. A failure marks it BROKEN and schedules the next attempt."""
        st = self._pairs.get(pair_key(p, d))
        if st is not None and st.status is PairStatus.CONNECTED:
            return True
        if st is None or st.task is None:
            st = self._start(p, d, st)
        assert st.task is not None
        await asyncio.wait({st.task})
        return st.status is PairStatus.CONNECTED

    def lost(self, p: str, d: str, error: str) -> None:
        """A transfer found the pair gone: BROKEN, tried again at once in the background."""
        st = self._pairs.get(pair_key(p, d))
        if st is None or st.status is not PairStatus.CONNECTED:
            return
        st.status, st.error, st.retry_at = PairStatus.BROKEN, error, time.monotonic()
        log.warning("pair %s -> %s lost: %s", p, d, error)

    def forget(self, worker_id: str) -> None:
        """Drop every pair of `worker_id` (it died or left); attempts under way are cancelled."""
        for key in [k for k in self._pairs if worker_id in k]:
            st = self._pairs.pop(key)
            if st.task is not None:
                st.task.cancel()

    def retry_due(self) -> None:
        """Start the background attempts whose backoff has passed."""
        now = time.monotonic()
        for st in list(self._pairs.values()):
            if st.status is PairStatus.BROKEN and st.task is None and now >= st.retry_at:
                self._start(*st.ends, st)

    def _start(self, p: str, d: str, st: PairState | None) -> PairState:
        if st is None:
            st = self._pairs[pair_key(p, d)] = PairState(PairStatus.CONNECTING, (p, d))
        st.status = PairStatus.CONNECTING if st.status is not PairStatus.BROKEN else st.status
        st.task = asyncio.ensure_future(self._attempt(*st.ends, st))
        return st

    async def _attempt(self, p: str, d: str, st: PairState) -> None:
        t0 = time.monotonic()
        try:
            await within(self._connect(p, d), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            st.failures += 1
            backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (st.failures - 1))
            if isinstance(exc, asyncio.TimeoutError):
                st.error = f"no answer within {self.timeout_s:.0f} s"
            else:
                st.error = f"{type(exc).__name__}: {exc}"
            st.status, st.retry_at = PairStatus.BROKEN, time.monotonic() + backoff
            log.warning(
                "pairing %s -> %s failed after %.1f s (%s); requests between them prefill on "
                "their decode worker until it connects; next attempt in %.0f s",
                p, d, time.monotonic() - t0, st.error, backoff,
            )  # fmt: skip
        else:
            if st.failures:
                log.info("pair %s -> %s connected after %d failed attempts", p, d, st.failures)
            st.status, st.failures, st.error = PairStatus.CONNECTED, 0, ""
        finally:
            st.task = None
