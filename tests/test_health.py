"""grpc.health.v1 on the gRPC port (router/health.py): Check, and Watch streams that end at
shutdown once they have said NOT_SERVING, however the shutdown falls against their writes (a
stream cancelled mid-write left its call open, and the server's drain waited for it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.health import DrainingHealth

S = health_pb2.HealthCheckResponse


async def _server() -> tuple[grpc.aio.Server, DrainingHealth, str]:
    server = grpc.aio.server()
    health = DrainingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("", S.SERVING)
    return server, health, f"127.0.0.1:{port}"


@pytest.mark.timeout(120)
def test_watches_end_at_shutdown_having_said_not_serving_and_hold_no_drain():
    async def main() -> None:
        server, health, address = await _server()
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == (
                S.SERVING
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            assert err.value.code() is grpc.StatusCode.NOT_FOUND
            calls = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(8)]
            for call in calls:  # each open, having said SERVING
                assert (await call.read()).status == S.SERVING
            # What the server's stop does: NOT_SERVING, then the streams end, in one go (the
            # writes of NOT_SERVING meet the end).
            await health.set("", S.NOT_SERVING)
            await health.end_watches()
            for call in calls:
                assert (await call.read()).status == S.NOT_SERVING
                assert await call.read() is grpc.aio.EOF
                assert await call.code() is grpc.StatusCode.OK
            late = stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)  # after the end
            assert [m.status async for m in late] == [S.NOT_SERVING]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await server.stop(30)  # nothing left open: no wait for the grace
        assert loop.time() - t0 < 5

    for _ in range(5):
        asyncio.run(main())


class _Context:
    """A Watch call's context: each write kept, then `pause(n)` awaited after the n-th, as the
    client reads it (none: at once)."""

    def __init__(self, pause: Callable[[int], Awaitable[Any]] | None = None) -> None:
        self.writes: list[int] = []
        self._pause = pause

    async def write(self, msg) -> None:
        self.writes.append(msg.status)
        if self._pause is not None:
            await self._pause(len(self.writes))


def _reading() -> _Context:
    return _Context()


def _stalled() -> _Context:
    """A client that reads the first write and then nothing: its writes never complete."""
    return _Context(lambda n: asyncio.sleep(0) if n == 1 else asyncio.Event().wait())


@pytest.mark.timeout(60)
def test_a_watcher_that_reads_nothing_holds_up_neither_a_change_nor_the_end_of_the_others():
    """Status changes and the shutdown's end of the watches go on while one watcher's write
    waits for its client: it holds up its own stream only."""

    async def main() -> None:
        health = DrainingHealth()
        await health.set("", S.SERVING)
        stalled, reading = _stalled(), _reading()
        req = health_pb2.HealthCheckRequest()
        stuck = asyncio.ensure_future(health.Watch(req, stalled))
        other = asyncio.ensure_future(health.Watch(req, reading))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(health.set("", S.NOT_SERVING), 2)  # the stalled one writes it
        await asyncio.sleep(0.05)
        await asyncio.wait_for(health.set("", S.SERVING), 2)
        await asyncio.wait_for(health.end_watches(), 2)
        await asyncio.wait_for(other, 2)
        assert reading.writes == [S.SERVING, S.NOT_SERVING, S.SERVING, S.NOT_SERVING]
        assert stalled.writes == [S.SERVING, S.NOT_SERVING] and not stuck.done()
        stuck.cancel()

    asyncio.run(main())


def _slow() -> _Context:
    """A slow client: each write takes a while (the end comes mid-write)."""
    return _Context(lambda n: asyncio.sleep(0.2))


@pytest.mark.timeout(30)
def test_a_watch_the_end_finds_mid_write_still_says_not_serving_before_it_ends():
    async def main() -> None:
        health = DrainingHealth()
        await health.set("", S.NOT_SERVING)
        slow = _slow()
        watch = asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(), slow))
        await asyncio.sleep(0.05)
        await health.set("", S.SERVING)
        await asyncio.sleep(0.25)  # its SERVING write under way
        await health.set("", S.NOT_SERVING)
        await health.end_watches()
        await asyncio.wait_for(watch, 5)
        assert slow.writes == [S.NOT_SERVING, S.SERVING, S.NOT_SERVING], slow.writes

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_watches_of_names_never_set_keep_nothing_and_a_later_status_reaches_them():
    """The health service is open (no token): a Watch of any name, however many, leaves
    nothing behind once it ends; one of a name set later gets its status then."""

    async def main() -> None:
        health = DrainingHealth()
        await health.set("", S.SERVING)
        sizes = {k: len(v) for k, v in vars(health).items() if hasattr(v, "__len__")}
        watches = [
            asyncio.ensure_future(
                health.Watch(health_pb2.HealthCheckRequest(service=f"no-{i}"), _reading())
            )
            for i in range(200)
        ]
        later = _reading()
        watch = asyncio.ensure_future(
            health.Watch(health_pb2.HealthCheckRequest(service="later"), later)
        )
        await asyncio.sleep(0.05)
        for w in watches:
            w.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        await health.set("later", S.SERVING)
        await asyncio.sleep(0.05)
        assert later.writes == [S.SERVICE_UNKNOWN, S.SERVING]
        await health.end_watches()
        await asyncio.wait_for(watch, 5)
        await health.set("", S.NOT_SERVING)
        after = {k: len(v) for k, v in vars(health).items() if hasattr(v, "__len__")}
        assert after == {**sizes, "_status": 2}, (sizes, after)  # "" and "later" only

    asyncio.run(main())
