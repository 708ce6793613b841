"""Live resizes of the pools (`pdserve scale`, router/admin.py): grow or shrink each pool to the
number asked. One resize at a time; the workers it adds take load once paired and warm
(Pools.grow), the ones it removes are drained: they take no new request, finish their own until
the drain deadline, and are then stopped (what still runs on a removed decode worker resumes
elsewhere, through the request core, as does a request of one token a removed prefill worker
was answering; a removed prefill worker's handoffs are prefilled on their decode workers).

A resize whose added workers wait for a node with room (none had it when they started: Ray
places them once one has) would hold every later resize until they come up or the start
deadline passes. While a later resize waits its turn, it replaces such a one: the waiting workers
are stopped, the rest of that resize (the workers it would remove) is not done, and its caller is
told so (ResizeReplaced). One whose workers all went to a node with room (loading a model takes
its time) is waited for; so is one whose workers an autoscaler's new node took in meanwhile, a
limit of this rule (the router does not ask Ray where a pending actor went).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from router.pools import Pools
from router.workers import WorkerHandle, WorkerStatus, done_unless, order
from worker_protocol.messages import WorkerRole

log = logging.getLogger("pdserve.pools")
WATCH_S = 0.2  # how often an addition looks whether a later resize waits behind it
FIELDS = {WorkerRole.PREFILL: "prefill", WorkerRole.DECODE: "decode", WorkerRole.BOTH: "workers"}


class ResizeReplaced(RuntimeError):
    """A later resize replaced this one while the workers it added waited for a node with room."""


def field_refusal(sizes: dict[WorkerRole, int | None], drain_timeout_s: float | None) -> str | None:
    """Why a resize's own fields are refused, naming the field (None: taken): a size below 0;
    a drain timeout below 0, inf or NaN (no end to the drain, which would hold every later
    resize)."""
    for role, n in sizes.items():
        if n is not None and n < 0:
            return f"{FIELDS[role]}: must be >= 0, got {n}"
    if drain_timeout_s is None or 0 <= drain_timeout_s < math.inf:
        return None
    return f"drain_timeout_s: must be a finite number >= 0, got {drain_timeout_s}"


class Resizes:
    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._one = asyncio.Lock()
        self._queued = 0  # resizes waiting their turn

    async def scale(
        self,
        num_prefill: int | None,
        num_decode: int | None,
        drain_timeout_s: float | None,
        num_both: int | None = None,
    ) -> None:
        """Grow or shrink each pool to the number given (None: as it is). At least one worker
        must be able to decode (a decode worker or one that does both). Raises ValueError (the
        message names the field), PoolsUnavailable, or ResizeReplaced."""
        want = {
            WorkerRole.PREFILL: num_prefill,
            WorkerRole.DECODE: num_decode,
            WorkerRole.BOTH: num_both,
        }
        refused = field_refusal(want, drain_timeout_s)
        if refused is not None:
            raise ValueError(refused)
        self._check(want)  # a refused resize leaves the one going on alone
        self._queued += 1
        try:
            await self._one.acquire()
        finally:
            self._queued -= 1
        try:
            self._check(want)
            add = {r: max(0, n - len(self._members(r))) for r, n in want.items() if n is not None}
            if any(add.values()):
                await self._add(add)
            victims = self._victims(want)
            timeout = self.pools.config.drain_timeout_s
            if drain_timeout_s is not None:
                timeout = drain_timeout_s
            await asyncio.gather(*(self._drain(h, timeout) for h in victims))
        finally:
            self._one.release()

    def _check(self, want: dict[WorkerRole, int | None]) -> None:
        after = {r: len(self._members(r)) if n is None else n for r, n in want.items()}
        most = self.pools.config.max_workers
        if sum(after.values()) > most:
            raise ValueError(
                f"{sum(after.values())} workers: at most {most} in all pools (pdserve serve "
                "--max-workers)"
            )
        if after[WorkerRole.DECODE] + after[WorkerRole.BOTH] < 1:
            raise ValueError(
                "decode: need at least 1 worker that decodes (a decode worker, or one of --workers)"
            )

    def _members(self, role: WorkerRole) -> list[WorkerHandle]:
        """Workers that count towards a pool's size: all but the draining and stopped ones."""
        gone = (WorkerStatus.DRAINING, WorkerStatus.STOPPED)
        return [h for h in self.pools.handles() if h.role is role and h.status not in gone]

    async def _add(self, counts: dict[WorkerRole, int]) -> None:
        """Add the workers; ResizeReplaced where a later resize waits while some of them wait
        for a node with room."""
        new: list[WorkerHandle] = []
        task = asyncio.ensure_future(self.pools.grow(counts, new))

        def waiting() -> list[str]:
            return [h.worker_id for h in new if h.info is None and h.node_id is None]

        try:
            if not await done_unless(task, lambda: bool(self._queued and waiting()), WATCH_S):
                names = ", ".join(waiting())  # as stop() found them: nothing ran in between
                log.warning("a later resize replaces the one going on: its %s wait for a node "
                            "with room", names)  # fmt: skip
                task.cancel()
                await asyncio.wait({task})  # its workers stopped (Pools.grow)
                raise ResizeReplaced(
                    f"a later resize replaced this one: {names} waited for a node with room; "
                    "the workers it added were stopped, and none it would remove was"
                )
        except asyncio.CancelledError:  # the caller's own end: its workers go with it
            task.cancel()
            raise
        task.result()

    def _victims(self, want: dict[WorkerRole, int | None]) -> list[WorkerHandle]:
        """Mark the workers to remove DRAINING: dead ones (a replacement pending) first, then the
        least busy, then the newest. One whose engine is not up (dead, or its replacement still
        starting) has nothing to drain and gives no load to watch: it is STOPPED at once, and a
        pending replacement stops on seeing it."""
        victims: list[WorkerHandle] = []
        with self.pools.lock:
            for role, n in want.items():
                members = self._members(role)
                if n is not None and len(members) > n:
                    members.sort(
                        key=lambda h: (
                            h.status is not WorkerStatus.DEAD,
                            h.active,
                            -order(h.worker_id),
                        )
                    )
                    victims += members[: len(members) - n]
            for h in victims:
                h.status = WorkerStatus.DRAINING if h.up else WorkerStatus.STOPPED
            self.pools.refresh_ids()
        return victims

    async def _drain(self, h: WorkerHandle, timeout_s: float) -> None:
        if h.status is WorkerStatus.STOPPED:  # never up: nothing ran there to finish
            await self.pools.retire(h, graceful=False)
            log.info("%s stopped before it was up: it left its pool", h.worker_id)
            return
        deadline = time.monotonic() + timeout_s
        while h.active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if h.active:
            log.warning("%s: %d requests still running after the %.0f s drain; they resume "
                        "elsewhere", h.worker_id, h.active, timeout_s)  # fmt: skip
        else:
            log.info("%s drained", h.worker_id)
        await self.pools.retire(h, graceful=not h.active)
        log.info("%s stopped: it left its pool", h.worker_id)
