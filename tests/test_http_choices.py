"""A request's n choices read together (router/http_choices.py), on stand-in core streams: a
refusal of one closes the others, a reader closed at any chunk leaves no task reading a stream
being closed, and every stream is closed once whatever ends the reading."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.core_types import CoreChunk
from router.http_choices import Choices, choice_seed, together


class Stream:
    """A core stream stand-in: `n` chunks (the last final) a tick apart; `fail_at` raises there."""

    def __init__(self, n: int, fail_at: int | None = None, delay: float = 0.001) -> None:
        self.n, self.fail_at, self.delay = n, fail_at, delay
        self.closed = 0
        self.gen = self._run()

    async def _run(self):
        try:
            for k in range(self.n):
                await asyncio.sleep(self.delay)
                if k == self.fail_at:
                    raise RuntimeError(f"failed at {k}")
                final = object() if k == self.n - 1 else None
                yield CoreChunk("r", (k,), str(k), final=final)  # type: ignore[arg-type]
        finally:
            self.closed += 1


def choices(*streams: Stream) -> Choices:
    return Choices([s.gen for s in streams])


def test_chunks_come_with_their_index_up_to_every_final():
    async def main():
        streams = [Stream(3), Stream(5, delay=0.002), Stream(1)]
        c = choices(*streams)
        got = [(i, ch.text) async for i, ch in c.merged(await c.firsts())]
        await c.aclose()
        return got, streams

    got, streams = asyncio.run(main())
    assert got[:3] == [(0, "0"), (1, "0"), (2, "0")]  # the first ones, in order
    for i, n in enumerate((3, 5, 1)):
        assert [t for j, t in got if j == i] == [str(k) for k in range(n)]
    assert [s.closed for s in streams] == [1, 1, 1]


async def logged(seen: list[str], i: int, delay: float, chunks: int = 3):
    """A choice's stream of `chunks` chunks, `delay` apart, that notes in `seen` when it starts
    and when its first token comes."""
    seen.append(f"start {i}")
    for k in range(chunks):
        await asyncio.sleep(delay)
        if k == 0:
            seen.append(f"token {i}")
        final = object() if k == chunks - 1 else None
        yield CoreChunk(f"r{i}", (k,), str(k), final=final)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [True, False])
def test_the_other_choices_start_once_choice_zero_has_its_first_token(stream):
    """Then its prompt's KV is in the prefix caches of the workers that computed and received
    it, where the others find it."""

    async def main():
        seen: list[str] = []
        c = Choices([logged(seen, 0, 0.05), logged(seen, 1, 0.001), logged(seen, 2, 0.001)])
        if stream:
            got = [(i, ch.text) async for i, ch in c.merged(await c.firsts())]
            assert got[:3] == [(0, "0"), (1, "0"), (2, "0")]
        else:
            assert [a.text for a in await c.answers()] == ["012"] * 3
        await c.aclose()
        return seen[:4]

    assert asyncio.run(main()) == ["start 0", "token 0", "start 1", "start 2"]


def test_a_batch_starts_every_prompts_first_choice_together_then_each_ones_others():
    """Two prompts of two choices each (streams 0-1 the first's, 2-3 the second's): both
    prompts' choice 0 start at once, each prompt's other choice once its own choice 0 has its
    first token, not the other prompt's."""

    async def main():
        seen: list[str] = []
        delays = (0.02, 0.001, 0.3, 0.001)  # the second prompt's first token comes much later
        c = Choices([logged(seen, i, d) for i, d in enumerate(delays)], n=2)
        got = [(i, ch.text) async for i, ch in c.merged(await c.firsts())]
        assert got[:4] == [(0, "0"), (1, "0"), (2, "0"), (3, "0")]
        await c.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen[:4] == ["start 0", "start 2", "token 0", "start 1"]
    assert seen.index("start 3") == seen.index("token 2") + 1


def test_a_refusal_of_one_first_chunk_is_raised_and_the_others_are_closed():
    async def main():
        streams = [Stream(4, delay=0.05), Stream(4, fail_at=0), Stream(4, delay=0.05)]
        c = choices(*streams)
        with pytest.raises(RuntimeError, match="failed at 0"):
            await c.firsts()
        await c.aclose()
        return streams

    assert [s.closed for s in asyncio.run(main())] == [1, 1, 1]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("after", [0, 1, 4])
def test_a_reader_closed_at_any_chunk_leaves_nothing_reading(n, after):
    """As the HTTP edge does when a write fails or its task is cancelled: the reading is closed
    at a yield, then the choices; no 'already running' error, each stream closed once."""

    async def main():
        streams = [Stream(50, delay=0.001 * (i + 1)) for i in range(n)]
        c = choices(*streams)
        reader = c.merged(await c.firsts())
        async with contextlib.aclosing(reader):
            k = 0
            async for _ in reader:
                if k == after:
                    break
                k += 1
        await c.aclose()  # the edge's close: it must not find a stream still being read
        await asyncio.sleep(0.01)
        return streams

    assert [s.closed for s in asyncio.run(main())] == [1] * n


def test_choices_closed_without_closing_their_reader_end_its_tasks_first():
    async def main():
        streams = [Stream(50), Stream(50, delay=0.002)]
        c = choices(*streams)
        reader = c.merged(await c.firsts())
        await anext(reader)
        await anext(reader)
        await anext(reader)  # a chunk read by a task of its own: the other's is in flight
        await c.aclose()
        return streams

    assert [s.closed for s in asyncio.run(main())] == [1, 1]


def test_a_failure_mid_answer_is_raised_and_every_stream_closes():
    async def main():
        streams = [Stream(30), Stream(30, fail_at=5), Stream(30)]
        c = choices(*streams)
        with pytest.raises(RuntimeError, match="failed at 5"):
            async for _ in c.merged(await c.firsts()):
                pass
        await c.aclose()
        return streams

    assert [s.closed for s in asyncio.run(main())] == [1, 1, 1]


def test_together_cancels_the_others_at_the_first_failure():
    async def main():
        ended: list[str] = []

        async def slow():
            try:
                await asyncio.sleep(10)
            finally:
                ended.append("slow")

        async def fails():
            await asyncio.sleep(0.01)
            raise ValueError("no")

        with pytest.raises(ValueError):
            await asyncio.wait_for(together([slow(), fails()]), 5)
        return ended

    assert asyncio.run(main()) == ["slow"]


def test_choice_seeds_keep_choice_zero_and_differ_from_each_other():
    assert choice_seed(5, 0) == 5
    seeds = {choice_seed(5, i) for i in range(16)} | {choice_seed(6, i) for i in range(16)}
    assert len(seeds) == 32 and all(0 <= s < 2**64 for s in seeds)


@pytest.mark.timeout(30)
def test_the_choices_bench_reports_a_first_choice_that_fails_before_its_first_token():
    """router/choices_bench.py, choice 0 first: a choice 0 that ends without a token (here a
    worker lost before it) is the run's error, not a wait without end for its first token."""
    from router.choices_bench import choices
    from router.errors import WorkerLost
    from router.vocab import RoutePath

    class Lost:
        async def kv_stats(self):
            return {}

        async def generate(self, ids, params, placement):
            raise WorkerLost("decode-0", "gone")
            yield  # an async generator, as Cluster.generate is

    async def main() -> None:
        run = choices(Lost(), [1, 2, 3], RoutePath.DISAGGREGATED, 3, 4, "first")  # type: ignore[arg-type]
        with pytest.raises(WorkerLost):
            await asyncio.wait_for(run, 10)

    asyncio.run(main())
