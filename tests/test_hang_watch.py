"""A stream's own watch on its worker (router/worker_calls.py, HangWatch), on stand-ins: a
worker that answers its pings is never taken for hung however long its stream is silent; one
that answers nothing, or only fails, is stopped once silent for the hang timeout; an answer
that came while the watch's own loop stalled counts; a worker the router's poll hears from is
not asked again; and the watch ends with its stream."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from router import worker_calls
from router.worker_calls import HangWatch, _watch

HANG_S = 0.4  # probe_s: 0.2


class Worker:
    """A handle stand-in whose actor's ping answers after `answer_s` (None: never; an
    exception: raises it at once)."""

    def __init__(self, answer_s: float | None | Exception) -> None:
        self.answered_at = 0.0
        self.calls = 0
        self.answer_s = answer_s
        self.up = True
        self.actor = SimpleNamespace(
            ping=SimpleNamespace(remote=lambda: asyncio.ensure_future(self._ping()))
        )

    async def _ping(self) -> None:
        self.calls += 1
        if isinstance(self.answer_s, Exception):
            raise self.answer_s
        if self.answer_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.answer_s)


class Pools:
    def __init__(self) -> None:
        self.stopped: list[tuple[Worker, float]] = []

    def stop_hung(self, h: Worker, silent_s: float) -> None:
        self.stopped.append((h, silent_s))


def _get(ref: asyncio.Task, timeout: float) -> None:
    if ref.cancelled():  # its wait ran out: no answer
        raise RuntimeError("not answered")
    return ref.result()


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """The stand-ins' pings are tasks, not Ray's refs: ready once done, answered unless
    cancelled (its wait ran out) or failed."""
    ready = lambda refs, timeout: ([r for r in refs if r.done()], [r for r in refs if not r.done()])  # noqa: E731
    monkeypatch.setattr(worker_calls.ray, "wait", ready)
    monkeypatch.setattr(worker_calls.ray, "get", _get)


def watch_for(seconds: float, w: Worker, polled: bool = False) -> Pools:
    """Run the watch of a stream silent from the start for `seconds`; with `polled`, the
    router's poll hears from the worker every 0.05 s meanwhile."""
    pools = Pools()

    async def main() -> None:
        watcher = asyncio.ensure_future(_watch(HangWatch(pools, w, HANG_S), [time.monotonic()]))  # type: ignore[arg-type]
        end = time.monotonic() + seconds
        while time.monotonic() < end and not watcher.done():
            if polled:
                w.answered_at = time.monotonic()
            await asyncio.sleep(0.05)
        watcher.cancel()

    asyncio.run(main())
    return pools


@pytest.mark.timeout(30)
def test_a_worker_that_answers_its_pings_is_never_taken_for_hung():
    w = Worker(answer_s=0.01)
    assert watch_for(2.0, w).stopped == []
    assert 3 <= w.calls <= 12, w.calls  # asked about once per probe_s of silence
    w.up, asked = False, w.calls  # gone (dead, stopped): its stream says so; the watch ends
    assert watch_for(1.0, w).stopped == [] and w.calls == asked


@pytest.mark.timeout(30)
def test_a_worker_that_answers_nothing_is_stopped_once_silent_for_the_hang_timeout():
    w = Worker(answer_s=None)
    t0 = time.monotonic()
    stopped = watch_for(5.0, w).stopped
    assert [h for h, _ in stopped] == [w], stopped
    silent = stopped[0][1]
    assert HANG_S <= silent <= time.monotonic() - t0, silent
    assert w.calls == 1  # one call, unanswered through the hang timeout


@pytest.mark.timeout(30)
def test_a_worker_the_routers_poll_hears_from_is_not_asked_again():
    w = Worker(answer_s=None)  # it would be taken for hung if asked
    assert watch_for(2.0, w, polled=True).stopped == []
    assert w.calls == 0


@pytest.mark.timeout(30)
def test_a_worker_whose_pings_only_fail_is_stopped_once_silent_for_the_hang_timeout():
    """Unreachable again and again (Ray's ActorUnavailableError): no answer, as the poll
    counts it, however quickly each ping fails."""
    w = Worker(answer_s=RuntimeError("unavailable"))
    stopped = watch_for(5.0, w).stopped
    assert [h for h, _ in stopped] == [w] and stopped[0][1] >= HANG_S, stopped
    assert w.calls >= 2, w.calls


@pytest.mark.timeout(30)
def test_an_answer_that_came_while_the_watch_stalled_counts(monkeypatch):
    """The ping's answer is in (Ray says it is ready) though the watch's wait ran out first
    (its loop blocked by a caller's work): the worker answered."""
    monkeypatch.setattr(worker_calls.ray, "wait", lambda refs, timeout: (refs, []))
    monkeypatch.setattr(worker_calls.ray, "get", lambda ref, timeout: None)
    w = Worker(answer_s=None)  # its await never ends here
    assert watch_for(2.0, w).stopped == []
    assert w.calls >= 2, w.calls


@pytest.mark.timeout(30)
def test_the_watch_ends_with_its_stream():
    """A reader that stops reading closes the stream (as both paths do): its watch is gone."""

    class Gen:
        def __aiter__(self):
            return self

        async def __anext__(self):
            done = asyncio.get_running_loop().create_future()
            done.set_result("chunk")
            return done

    method = SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=lambda *a: Gen()))

    def watches() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_watch"]

    async def main() -> None:
        w = Worker(answer_s=0.01)
        stream = worker_calls.stream_of(method, watch=HangWatch(Pools(), w, HANG_S))  # type: ignore[arg-type]
        assert await anext(stream) == "chunk"
        assert len(watches()) == 1
        await stream.aclose()
        await asyncio.sleep(0)
        assert watches() == []

    asyncio.run(main())
