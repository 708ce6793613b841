"""Live resizes of the pools (`pdserve scale`, router/admin.py): grow or shrink each pool to the
number asked. One resize at a time; the workers it adds take load once paired and warm
(Pools.grow), the ones it removes are drained: they take no new request, finish their own until
the drain deadline, and are then stopped (what still runs on a removed decode worker resumes
elsewhere, through the request core; a removed prefill worker's handoffs are prefilled on their
decode workers).

A resize whose added workers wait for a node with room (none had it when they were placed) would
hold every later resize until they come up or the start deadline passes. A later resize replaces
it: its waiting workers are stopped, and its caller is told so (ResizeReplaced). One whose workers
were all placed (loading a model takes its time) is waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from router.workers import WorkerHandle, WorkerStatus
from worker_protocol.messages import WorkerRole

if TYPE_CHECKING:
    from router.pools import Pools

log = logging.getLogger("pdserve.pools")
FIELDS = {WorkerRole.PREFILL: "prefill", WorkerRole.DECODE: "decode", WorkerRole.BOTH: "workers"}


class ResizeReplaced(RuntimeError):
    """A later resize replaced this one while the workers it added waited for a node with room."""


class Resizes:
    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._one = asyncio.Lock()
        # The workers being added now and the task adding them (None between additions).
        self._adding: tuple[asyncio.Future[list[WorkerHandle]], list[WorkerHandle]] | None = None

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
        for role, n in want.items():
            if n is not None and n < 0:
                raise ValueError(f"{FIELDS[role]}: must be >= 0")
        self._check(want)  # a refused resize leaves the one going on alone
        self._replace_waiting()
        async with self._one:
            self._check(want)
            add = {r: max(0, n - len(self._members(r))) for r, n in want.items() if n is not None}
            if any(add.values()):
                await self._add(add)
            victims = self._victims(want)
            timeout = self.pools.config.drain_timeout_s
            if drain_timeout_s is not None:
                timeout = drain_timeout_s
            await asyncio.gather(*(self._drain(h, timeout) for h in victims))

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
        new: list[WorkerHandle] = []
        task = asyncio.ensure_future(self.pools.grow(counts, new))
        self._adding = (task, new)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the caller's own end: its workers go with it
            task.cancel()
            raise
        finally:
            self._adding = None
        if task.cancelled():
            raise ResizeReplaced(
                "a later resize replaced this one: the workers it added waited for a node with "
                "room, and were stopped"
            )
        task.result()

    def _replace_waiting(self) -> None:
        """Stop the resize going on, if the workers it adds wait for a node with room."""
        if self._adding is None:
            return
        task, new = self._adding
        waiting = [h.worker_id for h in new if h.info is None and h.node_id is None]
        if waiting and not task.done():
            log.warning("a new resize replaces the one going on: its %s wait for a node with "
                        "room", ", ".join(waiting))  # fmt: skip
            task.cancel()

    def _victims(self, want: dict[WorkerRole, int | None]) -> list[WorkerHandle]:
        """Mark the workers to remove DRAINING (a pending replacement stops on seeing it): dead
        ones (a replacement pending) first, then the least busy, then the newest."""
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
                h.status = WorkerStatus.DRAINING
            self.pools.refresh_ids()
        return victims

    async def _drain(self, h: WorkerHandle, timeout_s: float) -> None:
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


def order(worker_id: str) -> int:
    """A worker's number within its pool ("decode-3": 3)."""
    return int(worker_id.rsplit("-", 1)[1])
