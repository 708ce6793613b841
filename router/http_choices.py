"""A request's `n` choices (OpenAI's `n`): n requests of the core, one per choice, read together.

Choice 0 is the request as asked (its id, its seed); choice i > 0 is the same request under its
own id (`<id>-<i>`) and, where a seed was given, its own seed made from it (choice_seed), so that
a seeded request gives the same n choices each time and n = 1 gives what it always gave. Each
choice is admitted, placed and metered as a request of its own; the answer goes out once all n
are admitted, and a refusal or a failure of any is the answer's. Choice 0 goes first and the
others once it has its first token: by then the prompt's KV is in the prefix cache of the worker
that computed it and of the one that received it, so the others find it there and compute and
send only its last block (started together, each handoff would move the whole prompt's KV).
A completion's batch of prompts is n choices per prompt (stream k*n + j is prompt k's choice j),
the prompts side by side: each prompt's choice 0 goes first, and its others once it has its
first token.
Closing the choices closes the reading of them, then every core stream, aborting each choice
wherever it still runs.

With one choice its stream is read in the reader's own task, as a plain stream is; with more,
each choice's next chunk is read by a task of its own (router/endings.py ends whichever task
reads a stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
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
    """The request's n choices. Prompt logprobs are asked of choice 0 alone (the others
    get its: Choices.firsts), so that the others may take the prompt from the prefix caches."""
    seed = req.sampling.seed
    sp = replace(req.sampling, prompt_logprobs=None)
    return [req] + [
        replace(
            req,
            request_id=f"{req.request_id}-{i}",
            sampling=sp if seed is None else replace(sp, seed=choice_seed(seed, i)),
        )
        for i in range(1, n)
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
    """The core streams of one request's choices, `n` per prompt (a completion may carry several
    prompts: stream i is choice i % n of prompt i // n)."""

    def __init__(
        self, streams: list[AsyncGenerator[CoreChunk, None]], n: int | None = None
    ) -> None:
        self.streams = streams
        self.n = n or len(streams)  # None: one prompt's
        self._merged: AsyncGenerator[tuple[int, CoreChunk], None] | None = None

    async def firsts(self) -> list[CoreChunk]:
        """Every choice's first chunk: each admitted and placed (a refusal of any is raised);
        each prompt's choice 0 first, then its others together (the prompts side by side).
        A prompt's other choices carry its choice 0's prompt logprobs (choice_requests)."""
        prompts = [self.streams[k : k + self.n] for k in range(0, len(self.streams), self.n)]
        if len(prompts) == 1:
            got = await _prompt_firsts(prompts[0])
        else:
            got = [c for cs in await together([_prompt_firsts(p) for p in prompts]) for c in cs]
        n = self.n
        return [
            replace(c, prompt_logprobs=lps)
            if i % n and (lps := got[i - i % n].prompt_logprobs)
            else c
            for i, c in enumerate(got)
        ]

    async def answers(self) -> list[Answer]:
        firsts = await self.firsts()
        return await together([collect(_from(f, s)) for f, s in zip(firsts, self.streams)])

    def merged(self, firsts: list[CoreChunk]) -> AsyncGenerator[tuple[int, CoreChunk], None]:
        """The choices' chunks with their index: the first ones (in order), then the others as
        they come, up to every choice's final chunk. A failure of any is raised. aclose()
        closes it first."""
        self._merged = self._one(firsts[0]) if len(firsts) == 1 else self._many(firsts)
        return self._merged

    async def _one(self, chunk: CoreChunk) -> AsyncGenerator[tuple[int, CoreChunk], None]:
        yield 0, chunk
        while chunk.final is None:
            chunk = await _next(self.streams[0])
            yield 0, chunk

    async def _many(self, firsts: list[CoreChunk]) -> AsyncGenerator[tuple[int, CoreChunk], None]:
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
        """Close the merged reading (its tasks cancelled and finished: none reads a stream
        then), then every stream (each aborts its choice wherever it still runs); raise the
        first failure of a close, if any."""
        if self._merged is not None:
            await self._merged.aclose()
        results = await asyncio.gather(*(s.aclose() for s in self.streams), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed


async def _prompt_firsts(streams: list[AsyncGenerator[CoreChunk, None]]) -> list[CoreChunk]:
    """One prompt's choices' first chunks: choice 0's, then the others' together."""
    first = await anext(streams[0])
    if len(streams) == 1:
        return [first]
    rest = await together([anext(s) for s in streams[1:]])  # type: ignore[arg-type]
    return [first, *rest]


async def _from(
    first: CoreChunk, stream: AsyncGenerator[CoreChunk, None]
) -> AsyncGenerator[CoreChunk, None]:
    """`first`, then the rest of the stream it came from."""
    yield first
    if first.final is None:
        async for chunk in stream:
            yield chunk


async def _next(stream: AsyncGenerator[CoreChunk, None]) -> CoreChunk:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise RuntimeError("a choice's stream ended before its final chunk") from None
