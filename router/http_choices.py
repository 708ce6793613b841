"""A request's `n` choices (OpenAI's `n`): n requests of the core, one per choice, read together.

Choice 0 is the request as asked; choice i > 0 is the same request under its own id (`<id>-<i>`)
and, where a seed was given, its own seed made from it (choice_seed), so that a seeded request
gives the same n choices each time and n = 1 gives what it always gave. Each choice is admitted,
placed and metered as a request of its own; the answer goes out once all n are admitted.
Closing the choices closes every core stream, aborting each choice wherever it still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import replace
from typing import TypeVar

from engine.sampler import sample_seed
from router.core_types import Answer, CoreChunk, collect
from router.request import ParsedRequest

T = TypeVar("T")
_CHOICE_SALT = 0xC40C_E5EE_D000_0000  # keeps choice seeds apart from the per-sample seeds


def choice_seed(seed: int, index: int) -> int:
    return seed if index == 0 else sample_seed(seed ^ _CHOICE_SALT, index)


def choice_requests(req: ParsedRequest, n: int) -> list[ParsedRequest]:
    if n == 1:
        return [req]
    sp, seed = req.sampling, req.sampling.seed
    return [
        replace(
            req,
            request_id=f"{req.request_id}-{i}",
            sampling=sp if seed is None else replace(sp, seed=choice_seed(seed, i)),
        )
        for i in range(n)
    ]


async def together(aws: list[Awaitable[T]]) -> list[T]:
    """All results, in order; at the first failure (or a cancellation) the others are cancelled
    and finished before it is raised, so that no task still reads a stream being closed."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t in done and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Choices:
    """The core streams of one request's choices."""

    def __init__(self, streams: list[AsyncGenerator[CoreChunk, None]]) -> None:
        self.streams = streams

    def __len__(self) -> int:
        return len(self.streams)

    async def firsts(self) -> list[CoreChunk]:
        """Every choice's first chunk: each admitted and placed (a refusal of any is raised)."""
        return await together([anext(s) for s in self.streams])  # type: ignore[arg-type]

    async def answers(self) -> list[Answer]:
        return await together([collect(s) for s in self.streams])

    async def merged(self, firsts: list[CoreChunk]) -> AsyncIterator[tuple[int, CoreChunk]]:
        """The choices' chunks with their index: the first ones (in order), then the others as
        they come, up to every choice's final chunk. A failure of any is raised."""
        reading: dict[asyncio.Future[CoreChunk], int] = {}

        def read(i: int) -> None:
            reading[asyncio.ensure_future(_next(self.streams[i]))] = i

        try:
            for i, chunk in enumerate(firsts):
                yield i, chunk
                if chunk.final is None:
                    read(i)
            while reading:
                done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=reading.__getitem__):
                    i = reading.pop(task)
                    chunk = task.result()
                    yield i, chunk
                    if chunk.final is None:
                        read(i)
        finally:
            for task in reading:
                task.cancel()
            await asyncio.gather(*reading, return_exceptions=True)

    async def aclose(self) -> None:
        """Close every stream (each aborts its choice wherever it still runs), then raise the
        first failure of a close, if any."""
        results = await asyncio.gather(*(s.aclose() for s in self.streams), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed


async def _next(stream: AsyncGenerator[CoreChunk, None]) -> CoreChunk:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise RuntimeError("a choice's stream ended before its final chunk") from None
