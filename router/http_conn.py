"""The HTTP port's connections, bounded: uvicorn's HTTP/1.1 protocol (h11) with the limits it
lacks, so that clients which open connections and send little cannot hold the router's file
descriptors (which the gRPC and metrics ports share with it) until every door stops answering.

- A request's head (its request line and headers) must come whole within HEAD_TIMEOUT_S of the
  connection's opening, or of the answer to its last request on a kept-alive connection: one
  that sends nothing, or sends its headers a line at a time (slowloris), is closed then.
- A request's body may pause at most BODY_IDLE_S (a Content-Length never reached, a chunked body
  that never ends).
- At most `client_limit.max_connections()` are open at once: one past it is closed as it
  opens.
- A client that reads nothing of its answer for client_limit.SEND_STALL_S while more waits to
  go out (the socket's buffers full) is taken as gone, as nginx's send_timeout does: the
  connection is cut, and its request ends as a client that left (aborted on its workers, its
  slot freed), rather than held with the rest of its answer in the router's memory for as long
  as it stays. A slow reader that reads at all is never cut.
- A request h11 refuses (malformed HTTP/1.x, or a head over its 16 KiB) is answered as every
  other error, with a JSON error object (431 for a head too large), where uvicorn's is plain
  text.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router import client_limit
from router.client_limit import max_connections
from router.refusal_log import Said

log = logging.getLogger("pdserve.http")

HEAD_TIMEOUT_S = 10.0
BODY_IDLE_S = 30.0
_CAPPED = Said(log, logging.WARNING)  # the server at its connection cap
_SLOW, _STALLED = Said(log), Said(log)


class BoundedH11Protocol(H11Protocol):
    """H11Protocol with the module's limits (see the module docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._head_since = self._last_data = self.loop.time()
        self._refused: h11.RemoteProtocolError | None = None
        self._h11_next_event = self.conn.next_event
        self.conn.next_event = self._next_event  # type: ignore[method-assign]
        if len(self.connections) > max_connections():
            _CAPPED.say(self.loop.time(), "HTTP connection from %s closed: %d are open, the most "
                        "allowed", _where(self.client), max_connections())  # fmt: skip
            transport.close()
            return
        self._watch(HEAD_TIMEOUT_S)

    def send_400_response(self, msg: str) -> None:
        """A request h11 refused (malformed, or its head too large): answered as every other
        error, with a JSON error object, and h11's status (431 for a head too large; uvicorn's
        own answer is plain text, 400 always)."""
        if self.conn.our_state is not h11.IDLE:  # an answer has begun: no other can be sent
            self.transport.close()
            return
        exc = self._refused
        status = getattr(exc, "error_status_hint", 400)
        said = str(exc)[:200]  # h11 quotes the line it refused, which may be long
        why = "its head is too large" if status == 431 else f"the HTTP parser refused it: {said}"
        body = {"message": f"request refused: {why}", "type": "invalid_request_error",
                "param": None, "code": None}  # fmt: skip
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase),
            h11.Data(data=json.dumps({"error": body}).encode()),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _next_event(self) -> Any:
        """h11's next event, and the error it raised kept for send_400_response."""
        try:
            return self._h11_next_event()
        except h11.RemoteProtocolError as exc:
            self._refused = exc
            raise

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # kept alive: the next head is awaited
            self._head_since = self.loop.time()
            self._watch(HEAD_TIMEOUT_S)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (getattr(self, "_guard", None), getattr(self, "_stall", None)):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(client_limit.SEND_STALL_S, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if not self.transport.is_closing():
            _STALLED.say(self.loop.time(), "HTTP connection from %s cut: it read nothing of its "
                         "answer for %g s", _where(self.client),
                         client_limit.SEND_STALL_S)  # fmt: skip
        self.transport.abort()  # close() would wait to send what it will never read

    def _watch(self, delay: float) -> None:
        if self._guard is not None:
            self._guard.cancel()
        self._guard = self.loop.call_later(max(delay, 0.0), self._check)

    def _check(self) -> None:
        self._guard = None
        if self.transport.is_closing():
            return
        now, state = self.loop.time(), self.conn.their_state
        if state is h11.IDLE:  # no whole head yet
            waited = now - self._head_since
            if waited < HEAD_TIMEOUT_S:
                self._watch(HEAD_TIMEOUT_S - waited)
            else:
                self._close(f"sent no whole request head within {HEAD_TIMEOUT_S:g} s")
        elif state is h11.SEND_BODY:  # the head came; the body is on its way
            idle = now - self._last_data
            if idle < BODY_IDLE_S:
                self._watch(BODY_IDLE_S - idle)
            else:
                self._close(f"sent nothing of its request's body for {BODY_IDLE_S:g} s")
        # Otherwise the request has come whole: the app has it.

    def _close(self, why: str) -> None:
        _SLOW.say(self.loop.time(), "HTTP connection from %s closed: it %s", _where(self.client),
                  why)  # fmt: skip
        self.transport.close()


def _where(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
