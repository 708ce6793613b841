"""The bounded wait for a KV transfer that both sides of a handoff use."""

from __future__ import annotations

import asyncio
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
