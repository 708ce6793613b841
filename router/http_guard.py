"""What the HTTP port checks before a request's body is read (an ASGI layer around the API): its
bearer token, where the server has one, and the body's size. FastAPI reads and parses a body
before any dependency runs, so without it a client without the token could make the router hold
and parse a body of any size; a JSON body takes several times its size once parsed.

Open without a token, as gRPC's health service is: /health, and the API's description
(/openapi.json, /docs). A body over MAX_BODY_BYTES (by its Content-Length, or as it arrives) is
refused with 413 before the rest is read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from router.http_errors import ApiError
from router.security import bearer_matches

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# A request body's limit: a prompt of a million token ids as JSON is about 8 MB.
MAX_BODY_BYTES = 16 << 20
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs"})


def unauthorized() -> ApiError:
    return ApiError(
        401, "authorization: a valid `Bearer <token>` is required", code="invalid_api_key"
    )


class Guard:
    def __init__(self, app: App, token: bytes | None, max_body: int = MAX_BODY_BYTES) -> None:
        self.app, self.token, self.max_body = app, token, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websocket route: nothing else is served
            await send({"type": "websocket.close", "code": 1008})
            return
        # The first of each header, as Starlette (and so the API's own check) reads it.
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        if self.token is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not bearer_matches(given, self.token):
                await _unread(unauthorized())(scope, receive, send)
                return
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body:
            await self._too_large()(scope, receive, send)
            return
        try:
            body = await self._body(receive)
        except _ClientLeft:
            return  # mid-body: nothing to answer
        if body is None:
            await self._too_large()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (the rest is not read); _ClientLeft
        when the client left before it ended."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientLeft
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self) -> Any:
        mib = self.max_body / (1 << 20)
        error = ApiError(413, f"body: over {mib:g} MiB", param="body", code="request_too_large")
        return _unread(error)


class _ClientLeft(Exception):
    pass


def _unread(error: ApiError) -> Any:
    """The answer to a request whose body was left unread: the connection closes after it,
    rather than reading the rest of the body to find the next request."""
    response = error.response()
    response.headers["connection"] = "close"
    return response


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body read already given first, whole; then what comes after it (the
    client's disconnect, which streaming responses watch for)."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
