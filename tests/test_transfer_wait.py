"""The bounded wait for a KV transfer that both sides of a handoff use."""

from __future__ import annotations

import asyncio
import threading
import time

from kv_transfer import TransferStatus
from worker_protocol.transfer_wait import wait_transfer


class NeverLands:
    """A receive whose KV never comes; an abort fails it, a release forgets it (a poll then
    raises KeyError, as the connector's does)."""

    def __init__(self) -> None:
        self.records = {"r": TransferStatus.PENDING}
        self.aborted: list[str] = []

    def poll(self, rid: str) -> TransferStatus:
        return self.records[rid]

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.records[rid] = TransferStatus.FAILED


def test_a_wait_ends_at_once_when_its_transfer_is_ended_elsewhere():
    """An abort elsewhere marks the request ended, then releases its receive: the wait stops
    polling at the mark (a poll after the release would raise), well before its deadline, and
    aborts nothing itself. With nothing marked, the deadline aborts the transfer."""
    conn, ended = NeverLands(), set()

    async def main():
        async def abort_elsewhere():
            await asyncio.sleep(0.1)
            ended.add("r")
            del conn.records["r"]  # released

        aborting = asyncio.create_task(abort_elsewhere())
        t0 = time.monotonic()
        status = await wait_transfer(conn, "r", 5.0, lambda: "r" in ended)  # type: ignore[arg-type]
        await aborting
        return status, time.monotonic() - t0

    status, took = asyncio.run(asyncio.wait_for(main(), 10))
    assert status is TransferStatus.FAILED and 0.1 <= took < 1.0
    assert conn.aborted == []
    late = NeverLands()
    t0 = time.monotonic()
    assert asyncio.run(wait_transfer(late, "r", 0.05)) is TransferStatus.FAILED  # type: ignore[arg-type]
    assert late.aborted == ["r"] and time.monotonic() - t0 < 1.0


class Running(NeverLands):
    """As the connector's table: a release of a transfer still running raises."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[str] = []

    def release(self, rid: str) -> None:
        if self.records[rid] is TransferStatus.PENDING:
            raise RuntimeError(f"transfer {rid!r} is still running; abort it first")
        self.released.append(rid)


def test_a_handoff_waiting_for_its_kv_stops_at_its_abort_and_leaves_the_receive_to_it():
    """The decode worker waits for a handoff's KV; an abort marks the request ended, and then
    (after an engine call) aborts and releases the receive. The wait stops at the mark, well
    before the transfer's deadline, without releasing a receive still running (that raises)."""
    from types import SimpleNamespace

    from worker_protocol.ended import EndedRequests
    from worker_protocol.kv_receiver import KVReceiverSide

    conn, ended = Running(), EndedRequests()
    side = KVReceiverSide()  # the receiving half of a worker: what _wait_kv reads of it
    side.spec = SimpleNamespace(kv_transfer_deadline_s=5.0)  # type: ignore[assignment]
    side.connector, side.ended = conn, ended  # type: ignore[assignment]

    async def main():
        async def mark():
            await asyncio.sleep(0.1)
            ended.add("r")  # the receive still runs: the abort ends it after an engine call

        marking = asyncio.create_task(mark())
        t0 = time.monotonic()
        ok = await side._wait_kv("r")
        await marking
        return ok, time.monotonic() - t0

    ok, took = asyncio.run(asyncio.wait_for(main(), 10))
    assert ok is False and took < 1.0
    assert conn.released == [] and conn.aborted == []
    assert conn.records["r"] is TransferStatus.PENDING  # left to the abort


class Stuck(Running):
    """As a transfer whose lane holds its data on a stuck link: ending it blocks the caller's
    thread until the lane lets go (STUCK_S here; up to the I/O timeout for real)."""

    STUCK_S = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.aborted_on: list[threading.Thread] = []

    def abort(self, rid: str) -> None:
        self.aborted_on.append(threading.current_thread())
        time.sleep(self.STUCK_S)
        super().abort(rid)


def _ticks_while(work) -> tuple[object, float]:
    """What `work()` returns, and the longest a 10 ms ticker on the same event loop waited for
    its turn meanwhile (tens of ms when the loop stayed free, even on a loaded host; STUCK_S
    when something blocked it)."""

    async def main():
        longest, done = 0.0, asyncio.Event()

        async def ticker():
            nonlocal longest
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                longest, last = max(longest, now - last), now

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        try:
            result = await work()
        finally:
            done.set()
            await ticking  # its last wait measured too (a block at the end of the work)
        return result, longest

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_a_transfer_ended_at_its_deadline_leaves_the_event_loop_free_meanwhile():
    """Past the deadline the wait aborts the transfer; the abort waits for a stuck lane on a
    thread of its own, while the worker's other requests (here a ticker) go on."""
    conn = Stuck()
    status, longest = _ticks_while(lambda: wait_transfer(conn, "r", 0.05))  # type: ignore[arg-type]
    assert status is TransferStatus.FAILED and conn.aborted == ["r"]
    assert conn.aborted_on[0] is not threading.main_thread()
    assert longest < 0.5 * Stuck.STUCK_S, longest


def test_an_abort_on_a_decode_worker_leaves_its_event_loop_free_while_the_receive_ends():
    """The router aborts a handoff whose prefill worker died mid-transfer: ending the receive
    waits for its lane, off the event loop, then the receive is released and the engine
    aborts the request; the worker's other streams (a ticker) go on meanwhile."""
    from engine.async_engine import AsyncEngine
    from tests.helpers import assert_pool_free, make_engine
    from worker_protocol.ended import EndedRequests
    from worker_protocol.kv_receiver import KVReceiverSide

    eng = make_engine("tiny-llama")
    side = KVReceiverSide()
    conn = Stuck()
    side.connector, side.ended, side.aeng = conn, EndedRequests(), AsyncEngine(eng)  # type: ignore[assignment]
    try:
        _, longest = _ticks_while(lambda: side.abort_receive("r"))
    finally:
        side.aeng.shutdown()
    assert "r" in side.ended and conn.aborted == ["r"] and conn.released == ["r"]
    assert conn.aborted_on[0] is not threading.main_thread()
    assert longest < 0.5 * Stuck.STUCK_S, longest
    assert_pool_free(eng)


class Forgotten(Stuck):
    """As Stuck, where a release forgets the record (a poll then raises KeyError, as the
    connector's table does)."""

    def abort(self, rid: str) -> None:
        self.aborted_on.append(threading.current_thread())
        time.sleep(self.STUCK_S)
        if rid in self.records:
            self.records[rid] = TransferStatus.FAILED

    def release(self, rid: str) -> None:
        self.records.pop(rid, None)


def test_a_transfer_ended_elsewhere_while_its_deadline_abort_waits_is_not_polled_again():
    """The wait's deadline abort waits for a stuck lane; meanwhile the request's abort marks it
    ended and releases the record. The wait then reports FAILED without polling a record that
    is gone."""
    conn, ended = Forgotten(), set()

    async def main():
        async def abort_elsewhere():
            await asyncio.sleep(0.15)  # the wait's own abort is under way by now
            ended.add("r")
            conn.release("r")

        aborting = asyncio.create_task(abort_elsewhere())
        status = await wait_transfer(conn, "r", 0.05, lambda: "r" in ended)  # type: ignore[arg-type]
        await aborting
        return status

    assert asyncio.run(asyncio.wait_for(main(), 10)) is TransferStatus.FAILED
    assert len(conn.aborted_on) == 1 and "r" not in conn.records
