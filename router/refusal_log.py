"""Admission refusals in the server's log: the first one after a quiet spell at once, then one
line per window while they go on, with the counts by reason and front door. Each refusal is
also counted in pdserve_admission_rejections_total; the log says that the server is refusing,
and why, without a line per request under overload. `Said`: the same for a line of one kind
(connections closed, answers cut short)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from router.vocab import Frontend, RejectReason

log = logging.getLogger("pdserve.router")

WINDOW_S = 10.0  # refusals, and any flood of one kind of line, said once a window

WHY = {
    RejectReason.QUEUE_FULL: "too many requests wait for a first token (--max-pending)",
    RejectReason.SLO: "its predicted TTFT misses its SLO while the queue drains",
    RejectReason.DECODE_RATE: "requests come faster than the decodes hold the ITL SLO",
    RejectReason.CLIENT_LIMIT: "its client runs as many requests as it may "
    "(--max-streams-per-client)",
    RejectReason.NO_WORKERS: "no worker that decodes is up",
}


class RefusalLog:
    """Counts refusals and logs them at most once per `window_s` (the first at once). Any
    thread."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._counts: Counter[tuple[RejectReason, Frontend]] = Counter()
        self._since: float | None = None  # start of the window being counted; None: quiet
        self._last = 0.0  # the latest refusal counted in it

    def refused(self, reason: RejectReason, frontend: Frontend, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._since is None or now - self._since >= 2 * self.window_s:
                # After a quiet spell: this one at once, and what the last window left unsaid
                # (over the time it was refusing, not the quiet since).
                left = self._summary(self._last, now) if self._counts else ""
                self._counts.clear()
                self._since = now
                log.warning(
                    "refusing requests (%s): %s: %s%s; counted in "
                    "pdserve_admission_rejections_total, logged every %.0f s while it lasts",
                    frontend.value, reason.value, WHY[reason],
                    f"; before: {left}" if left else "", self.window_s,
                )  # fmt: skip
                return
            self._counts[reason, frontend] += 1
            self._last = now
            if now - self._since >= self.window_s:
                self._say_window(now, now)
                self._since = now

    def flush(self, now: float | None = None) -> None:
        """Say what the window has counted and not yet said (the server stopping)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._counts:
                self._say_window(self._last, now)

    def _say_window(self, last: float, now: float) -> None:
        """The window's counts to the log (_summary), and a new count begun."""
        log.warning("refused %s", self._summary(last, now))
        self._counts.clear()

    def _summary(self, last: float, now: float) -> str:
        """The window's counts, from its start to `last` (its latest refusal), said at `now`."""
        assert self._since is not None
        n = sum(self._counts.values())
        parts = ", ".join(f"{r.value} {c} ({f.value})" for (r, f), c in self._counts.most_common())
        if now - last < 1:
            return f"{n} requests in the last {now - self._since:.0f} s: {parts}"
        span = f"{n} requests over {last - self._since:.0f} s, up to {now - last:.0f} s ago"
        return f"{span}: {parts}"


class Said:
    """One kind of line in the log (a connection closed, an answer cut short): the first at
    once, then at most a line per WINDOW_S with how many since."""

    def __init__(self, logger: logging.Logger, level: int = logging.INFO) -> None:
        self.log, self.level = logger, level
        self.at, self.since = float("-inf"), 0

    def say(self, now: float, line: str, *args: object, n: int = 1) -> None:
        """Count n more of the kind (requests, connections); say the line if the window is over."""
        self.since += n
        if now - self.at >= WINDOW_S:
            self.log.log(self.level, line + " (%d such since the last line)", *args, self.since)
            self.at, self.since = now, 0
