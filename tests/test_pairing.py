"""The pair book with a fake connect: one attempt however many wait, bounded by its timeout, a
backoff that doubles, background retries, and a pair lost by a transfer made again."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.pairing import PairBook, PairStatus


class FakeConnect:
    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = outcomes  # "ok", "fail" or "hang", one per attempt
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, p: str, d: str) -> None:
        self.calls.append((p, d))
        what = self.outcomes.pop(0)
        if what == "fail":
            raise ConnectionError("refused")
        if what == "hang":
            await asyncio.sleep(3600)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_one_attempt_serves_every_waiter_and_connects():
    async def main():
        connect = FakeConnect(["ok"])
        book = PairBook(connect)
        oks = await asyncio.gather(*(book.pair("p", "d") for _ in range(5)))
        return connect, book, oks

    connect, book, oks = run(main())
    assert oks == [True] * 5 and connect.calls == [("p", "d")]
    assert book.connected("p", "d")


def test_a_hung_attempt_costs_its_timeout_once_then_backs_off():
    async def main():
        connect = FakeConnect(["hang", "fail", "ok"])
        book = PairBook(connect, timeout_s=0.2, backoff_s=0.3, max_backoff_s=10)
        t0 = time.monotonic()
        ok = await book.pair("p", "d")
        waited = time.monotonic() - t0
        st = book.state("p", "d")
        assert not ok and st.status is PairStatus.BROKEN and st.failures == 1
        assert "no answer within" in st.error and "broken" in book.why_not("p", "d")
        book.retry_due()  # before the backoff: nothing
        assert connect.calls == [("p", "d")]
        await asyncio.sleep(0.35)
        book.retry_due()  # in the background: fails again, the backoff doubles
        await asyncio.sleep(0.05)
        assert st.failures == 2 and st.retry_at - time.monotonic() > 0.4
        await asyncio.sleep(0.6)
        book.retry_due()
        await asyncio.sleep(0.05)
        return waited, book, connect

    waited, book, connect = run(main())
    assert 0.2 <= waited < 0.5
    assert book.connected("p", "d") and book.state("p", "d").failures == 0
    assert len(connect.calls) == 3


def test_a_pair_lost_by_a_transfer_is_made_again_in_the_background():
    async def main():
        connect = FakeConnect(["ok", "ok"])
        book = PairBook(connect)
        assert await book.pair("p", "d")
        book.lost("p", "d", "a transfer failed")
        assert not book.connected("p", "d")
        book.retry_due()  # due at once
        await asyncio.sleep(0.05)
        return book, connect

    book, connect = run(main())
    assert book.connected("p", "d") and len(connect.calls) == 2


def test_forgetting_a_worker_drops_its_pairs_and_cancels_attempts():
    async def main():
        book = PairBook(FakeConnect(["hang", "ok"]), timeout_s=5)
        task = asyncio.ensure_future(book.pair("p", "d"))
        await asyncio.sleep(0.05)
        attempt = book.state("p", "d").task
        book.forget("p")
        await asyncio.sleep(0.05)
        task.cancel()
        return book, attempt

    book, attempt = run(main())
    assert book.state("p", "d") is None and attempt.cancelled()


@pytest.mark.parametrize("failures, backoff", [(1, 5.0), (3, 20.0), (10, 120.0)])
def test_backoff_doubles_up_to_its_cap(failures, backoff):
    async def main():
        book = PairBook(FakeConnect(["fail"] * failures), backoff_s=5, max_backoff_s=120)
        for _ in range(failures):
            await book.pair("p", "d")  # an attempt now, whatever the backoff says
        st = book.state("p", "d")
        return st, st.retry_at - time.monotonic()

    st, wait = run(main())
    assert st.failures == failures
    assert wait == pytest.approx(backoff, abs=0.5)


def test_a_pair_is_one_whichever_way_it_is_named():
    """Workers that both prefill and decode send KV either way over one pair: naming it (a, b)
    or (b, a) joins one attempt, and each order reads the same state."""

    async def main():
        connect = FakeConnect(["ok"])
        book = PairBook(connect)
        oks = await asyncio.gather(book.pair("both-0", "both-1"), book.pair("both-1", "both-0"))
        return connect, book, oks

    connect, book, oks = run(main())
    assert oks == [True, True] and connect.calls == [("both-0", "both-1")]
    assert book.connected("both-1", "both-0") and book.connected("both-0", "both-1")
    assert book.state("both-1", "both-0") is book.state("both-0", "both-1")
    book.lost("both-1", "both-0", "a transfer failed")
    assert not book.connected("both-0", "both-1")
    book.forget("both-1")
    assert book.state("both-0", "both-1") is None
