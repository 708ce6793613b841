"""Ending the requests in flight when the server stops: its drain timeout passed, or it was
interrupted again. Each ends with ShuttingDown, which both front doors answer as they answer
any failure (gRPC UNAVAILABLE; HTTP 503, or an error event mid-stream), aborted on its workers
as its stream closes; where the front doors' own shutdown would cancel their calls instead (gRPC's
"Cancelling all calls", a cut HTTP body).

The core's stream of a request runs in the task of whoever reads it (the HTTP edge reads its
first chunk in one task and the rest in another; each of a request's n choices has a task per
chunk): after each chunk it notes the task reading it.
A stream waiting for its next chunk there is ended by cancelling that task, the cancellation
taken back and turned into ShuttingDown inside the stream; one whose reader holds a chunk (a
write in progress) ends when it asks for the next."""

from __future__ import annotations

import asyncio

from router.errors import ShuttingDown


class LiveStream:
    """One request's stream in the core."""

    __slots__ = ("task", "inside", "why")

    def __init__(self) -> None:
        self.task = asyncio.current_task()  # the task reading it now
        self.inside = True  # awaiting its next chunk (else its reader holds the last one)
        self.why: str | None = None  # set: ended, and why

    def yielding(self) -> None:
        """A chunk goes to the reader."""
        self.inside = False

    def resumed(self) -> None:
        """The reader asks for the next chunk (raises ShuttingDown where it was ended)."""
        self.task = asyncio.current_task()
        self.inside = True
        if self.why is not None:
            raise ShuttingDown(self.why)

    def cancelled(self) -> ShuttingDown | None:
        """The stream caught a cancellation: ShuttingDown (the cancellation taken back) where it
        came from end_all, else None (its reader left, also where that came at the same time:
        let the cancellation through)."""
        if self.why is None:
            return None
        uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11 on
        if uncancel is not None and uncancel() > 0:
            return None  # another cancellation stands
        return ShuttingDown(self.why)


class Endings:
    """The core's live streams, and ending them all."""

    def __init__(self) -> None:
        self.live: set[LiveStream] = set()
        self.why: str | None = None  # set by end_all: a stream opened after it ends at once

    def open(self) -> LiveStream:
        """A new request's stream (raises ShuttingDown once end_all has run)."""
        if self.why is not None:
            raise ShuttingDown(self.why)
        s = LiveStream()
        self.live.add(s)
        return s

    def close(self, s: LiveStream) -> None:
        self.live.discard(s)

    def end_all(self, why: str) -> int:
        """End every live stream with ShuttingDown(why), and every one opened later; returns
        how many were ended now. On the event loop."""
        if self.why is None:
            self.why = why
        n = 0
        for s in self.live:
            if s.why is not None:
                continue
            s.why, n = why, n + 1
            if s.inside and s.task is not None:
                s.task.cancel()
        return n
