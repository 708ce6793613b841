"""Calls to a worker's actor that both of a request's paths make: aborting a request there for
good, streaming a call's chunks, and telling a worker gone (its actor died, or its engine
stopped) from one that cannot be reached for now (Ray's ActorUnavailableError: it may come
back)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import ray

from engine.async_engine import EngineDeadError
from router.pools import Pools
from router.workers import WorkerHandle, WorkerStatus, within
from worker_protocol.messages import TokenChunk

log = logging.getLogger("pdserve.cluster")

# What a call to a worker raises when the worker is gone: its actor died (Ray's memory monitor
# killing it included), or its engine stopped. Among those, what it raises while the worker
# cannot be reached for now (it may come back).
GONE = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError, EngineDeadError)
UNAVAILABLE = ray.exceptions.ActorUnavailableError
UNAVAILABLE_RETRY_S = 0.5  # between tries of an abort on a worker unreachable for now


def lost(pools: Pools, h: WorkerHandle, exc: BaseException) -> bool:
    """Whether `exc`, raised by a call to `h`, says `h` is gone: its actor died (it then leaves
    its pool: Pools.note_failure), or its engine stopped (a resize removed it as the call
    reached it). Either way its requests go on elsewhere."""
    return pools.note_failure(h, exc) or isinstance(exc, EngineDeadError)


async def abort_until(h: WorkerHandle, rid: str, timeout_s: float) -> BaseException | None:
    """Abort `rid` on `h` within `timeout_s`: None once `h` answered, else what the last try
    raised. A worker unreachable for now (ActorUnavailableError) may still hold the request's
    blocks and come back: its abort is tried again every UNAVAILABLE_RETRY_S until the
    timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = max(0.0, deadline - time.monotonic())
            await within(h.actor.abort.remote(rid), left)
            return None
        except UNAVAILABLE as exc:
            if deadline - time.monotonic() < 2 * UNAVAILABLE_RETRY_S:  # no room for a try
                return exc
            await asyncio.sleep(UNAVAILABLE_RETRY_S)
        except Exception as exc:
            return exc


async def abort_on(h: WorkerHandle, rid: str, timeout_s: float) -> bool:
    """Abort `rid` on one worker, for good (it then ignores a call for `rid` that Ray runs
    after the abort), trying again while it is unreachable (abort_until); False when it did not
    answer in time (or failed), which is logged."""
    exc = await abort_until(h, rid, timeout_s)
    if exc is not None:
        abort_failed(h, rid, exc)
    return exc is None


def abort_failed(h: WorkerHandle, rid: str, exc: BaseException) -> None:
    log.warning("abort of %s on %s failed: %s: %s", rid, h.worker_id, type(exc).__name__, exc)


async def settle_abort(
    abort: Coroutine[Any, Any, Any], closing: bool, later: Callable[[Coroutine[Any, Any, Any]], Any]
) -> None:
    """Run a request's `abort` to its end, shielded from the caller's cancellation (its blocks
    are free once its books settle); while the server closes, leave it to `later` (the
    supervisor loop's submit), so that the request's answer goes out first (a stopped worker
    would hold the abort to the control timeout)."""
    if closing:
        later(abort)
    else:
        await asyncio.shield(abort)


async def abort_soon(
    h: WorkerHandle, rid: str, timeout_s: float, later: Callable[[Coroutine[Any, Any, bool]], Any]
) -> BaseException | None:
    """Abort `rid` on `h` with one try within `timeout_s`: None once `h` answered, else what the
    try raised. A worker unreachable for now gets the rest of the tries (abort_on) through
    `later` (the supervisor loop's submit), so that no request waits on it. A failure is logged
    here, unless the worker is gone (nothing is left there to free)."""
    try:
        await within(h.actor.abort.remote(rid), timeout_s)
        return None
    except UNAVAILABLE as exc:
        log.info("abort of %s on %s: unreachable for now, tried again until it answers",
                 rid, h.worker_id)  # fmt: skip
        later(abort_on(h, rid, timeout_s))  # which logs it if it never does
        return exc
    except Exception as exc:
        if not isinstance(exc, GONE):
            abort_failed(h, rid, exc)
        return exc


# A stream silent this long (or half the hang timeout, if less) pings its worker: answered, the
# worker is stepping.
PROBE_AFTER_S = 5.0


@dataclass(frozen=True, slots=True)
class HangWatch:
    """A stream's watch on its worker `h`: silent (no chunk) for `probe_s`, it pings `h`,
    which a worker answers between two engine steps (worker_protocol/host.py), as a load. No
    answer within `hang_s` either: `h` is hung, as the load poll's watchdog would find it
    (router/load_poll.py), and it is stopped the same way (Pools.stop_hung: killed, replaced),
    so the stream ends with its death. Without it a stream from a stopped process (SIGSTOP) or
    a stuck engine waited without end where nothing polled (Cluster used from Python)."""

    pools: Pools
    h: WorkerHandle
    hang_s: float

    @property
    def probe_s(self) -> float:
        return min(PROBE_AFTER_S, self.hang_s / 2)


def hang_watch(pools: Pools, h: WorkerHandle, hang_s: float) -> HangWatch | None:
    """A stream's watch on `h` (none with the watchdog off: a hang timeout of 0)."""
    return HangWatch(pools, h, hang_s) if hang_s > 0 else None


async def stream_of(
    method: Any, *args: Any, watch: HangWatch | None = None
) -> AsyncGenerator[TokenChunk, None]:
    """The chunks of a streaming call to a worker's actor, as they come; with `watch`, a worker
    found hung meanwhile is stopped (one task per stream: nothing more per chunk than a time)."""
    gen = method.options(num_returns="streaming").remote(*args)
    if watch is None:
        async for ref in gen:
            yield await ref
        return
    last = [time.monotonic()]  # the last chunk's time
    watcher = asyncio.ensure_future(_watch(watch, last))
    try:
        async for ref in gen:
            last[0] = time.monotonic()
            yield await ref
    finally:
        watcher.cancel()


async def _watch(watch: HangWatch, last: list[float]) -> None:
    """Stop `watch.h` once its stream has been silent, and its pings unanswered, for long. A
    load the router's poll got from it meanwhile is an answer too: a polled worker is not
    asked again (one ping per stream and `probe_s` where nothing polls). A ping that fails is
    no answer (Ray's ActorUnavailableError again and again, as the poll counts it); one that
    says the worker died leaves the rest to the stream, which fails with it."""
    h = watch.h
    try:
        while h.up:
            await asyncio.sleep(watch.probe_s)
            if time.monotonic() - max(last[0], h.answered_at) < watch.probe_s:
                continue
            ref: Any = h.actor.ping.remote()
            with contextlib.suppress(Exception):  # the wait's end, or the ping's own failure
                await within(ref, watch.hang_s)
            # Answered: the ping's result, read here alone (an answer that came while this loop
            # stalled, a caller's blocking work, counts too).
            if ray.wait([ref], timeout=0)[0]:
                with contextlib.suppress(Exception):
                    ray.get(ref, timeout=0)
                    h.answered_at = time.monotonic()
            silent = time.monotonic() - max(last[0], h.answered_at)
            if silent >= watch.hang_s:  # no chunk, nor an answer to a ping or a poll
                watch.pools.stop_hung(h, silent)
                return
    except Exception:  # the watch's own failure (Ray shut down under it): said, not raised
        log.exception("the hang watch on %s stopped", h.worker_id)


def why_gone(h: WorkerHandle) -> str:
    return "it is leaving its pool" if h.status is WorkerStatus.DRAINING else "not in its pool"


def renew(ids: list[str]) -> str:
    """The next id a request goes by on its workers after a reset; appended to `ids`."""
    ids.append(f"{ids[0]}.{len(ids)}")
    return ids[-1]
