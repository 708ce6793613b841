"""How the HTTP API notices a client that left: a watch on the ASGI receive channel beside the
work, and a streamed response that owns the request's core stream and client slot, so that a
closed connection (before or after the first token) aborts the request on its workers at once
and every exit, however it comes, closes the stream and frees the slot."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Send


async def until_disconnected(receive: Receive, work: Awaitable[Any]) -> Any:
    """`work`'s result, or None (with `work` cancelled and finished) once the client has
    disconnected. Cancelled itself, it cancels `work` and waits for it to finish too."""
    task = asyncio.ensure_future(work)

    async def left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(left())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        # Both finish before anyone touches what `work` was using (the core's stream).
        await asyncio.gather(task, watch, return_exceptions=True)
    return task.result() if task in done else None


class Closable(Protocol):
    async def aclose(self) -> None: ...


async def close(chunks: Closable, release: Callable[[], None]) -> None:
    """Close the core's stream or streams (aborting the request wherever it still runs), then
    free the client's slots, whatever the close raises."""
    try:
        await chunks.aclose()
    finally:
        release()


class EventStream(StreamingResponse):
    """Server-sent events that notice a closed connection at once, not at their next write."""

    def __init__(
        self,
        events: AsyncIterator[str],
        chunks: Closable,
        release: Callable[[], None],
        headers: dict[str, str],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._chunks = chunks
        self._release = release

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        async def respond() -> None:
            with contextlib.suppress(OSError):  # the client left mid-write
                await self.stream_response(send)

        try:
            await until_disconnected(receive, respond())
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                await close(self._chunks, self._release)
