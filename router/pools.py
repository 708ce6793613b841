"""The pools of workers (prefill, decode, and workers that do both): their actors over time
(router/workers.py for the states), the KV pairs between them (router/pairing.py), and every
change of membership. Two workers are paired when one can prefill for the other: a prefill
worker with every decode-capable one, a worker that does both with every other worker.

  start     every worker's actor is created (placed by its pool's Placement), its engine comes
            up, the pairs between the pools are made, each worker runs a warm-up request, and
            then all take load;
  death     a worker whose actor is found dead (a request or a load poll gets Ray's actor
            error) leaves its pool at once; a new incarnation under the same id is started,
            paired and warmed, and takes load once ready; restarts back off when they fail;
  resize    router/resize.py adds workers (`grow`: they take load once paired and warm) and
            drains the ones it removes (`retire` stops them).
Everything that changes membership runs on one supervisor loop (its own thread), so it
outlives the request or the caller that set it off, except noting a death, which the thread that
saw it does. How one worker comes up, and the members' book with its lock: router/worker_starts.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Collection
from typing import Any

import ray

from router.cluster_config import PoolConfig
from router.worker_starts import PEERS, WorkerStarts
from router.workers import WorkerHandle, WorkerStatus, within
from worker_protocol.messages import WorkerInfo, WorkerRole

log = logging.getLogger("pdserve.pools")
Counts = dict[WorkerRole, int]
HUNG = "hung"  # the error of a worker stopped for giving no load (stop_hung)
ENGINES_STOP_S = 10.0  # for every engine to stop at shutdown, all together


class PoolsUnavailable(RuntimeError):
    """Workers did not come up (placement, resources, a failing engine); the message says why."""


class Pools(WorkerStarts):
    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        self.dead: list[str] = []  # ids of workers found dead, in the order found
        # Workers stopped for answering no load poll (in `dead` too, unless being removed).
        self.hung: list[str] = []
        self.restarts: dict[WorkerRole, int] = {r: 0 for r in WorkerRole}
        self._closing = False
        self._starting: concurrent.futures.Future[list[WorkerHandle]] | None = None
        self._start_cancelled = False
        self._maintainer = self.ops.submit(self._maintain())

    # -- start ---------------------------------------------------------------------------------
    def start(self, counts: Counts) -> None:
        """Bring up the pools, `counts` workers of each role (blocking); raises PoolsUnavailable
        when they don't come up."""
        limit = self.config.start_timeout_s + 3 * self.config.pair_timeout_s + 30
        with self.lock:
            if self._start_cancelled:  # before it began
                raise PoolsUnavailable("the start was cancelled")
            self._starting = starting = self.ops.submit(self.grow(counts))
        try:
            starting.result(limit)
        except concurrent.futures.TimeoutError:
            raise PoolsUnavailable(f"the workers did not come up within {limit:.0f} s") from None
        except concurrent.futures.CancelledError:
            raise PoolsUnavailable("the start was cancelled") from None

    def cancel_start(self) -> None:
        """End start() (from another thread; before it began, too): its workers are stopped,
        and it raises."""
        with self.lock:
            self._start_cancelled = True
            if self._starting is not None:
                self._starting.cancel()

    async def grow(
        self, counts: Counts, new: list[WorkerHandle] | None = None
    ) -> list[WorkerHandle]:
        """Add workers and bring them up together; all or nothing (PoolsUnavailable). `new`
        gets each worker's handle as its actor is created."""
        new = [] if new is None else new
        try:
            for role in WorkerRole:
                new += [self._spawn(role, self._new_id(role)) for _ in range(counts.get(role, 0))]
            ok = await asyncio.gather(*(self._engine_up(h) for h in new))
            if not all(ok):
                failed = [f"{h.worker_id}: {h.error}" for h, up in zip(new, ok) if not up]
                raise PoolsUnavailable("workers did not start: " + "; ".join(failed))
            await asyncio.gather(*(self._pair_up(h) for h in new))
            await asyncio.gather(*(self._warm(h) for h in new))
        except BaseException:
            for h in new:
                self._stop_actor(h, WorkerStatus.STOPPED)
                self._drop(h)
                self.pairs.forget(h.worker_id)
            raise
        with self.lock:
            for h in new:
                if h.status is WorkerStatus.STARTING:  # (one may have died meanwhile)
                    h.status = WorkerStatus.READY
            self.refresh_ids()
        return new

    # -- death ---------------------------------------------------------------------------------
    def note_failure(self, h: WorkerHandle, exc: BaseException) -> bool:
        """True when `exc` says that `h`'s actor died (now or before); it then leaves its pool and
        a replacement starts (unless it was being removed). Any thread. Ray's memory monitor
        killing the process that ran the call (OutOfMemoryError) kills the actor: that process
        is the actor's own."""
        if isinstance(exc, ray.exceptions.OutOfMemoryError):
            if h.up and not self._closing:
                self.ops.submit(self._kill(h))  # should it live on, it holds its device
            if self._dead(h, "OutOfMemoryError") and not self._closing:
                log.warning("worker %s was killed by Ray's memory monitor and left its pool",
                            h.worker_id)  # fmt: skip
            return True
        if not isinstance(exc, ray.exceptions.RayActorError) or isinstance(
            exc,
            ray.exceptions.ActorUnavailableError,  # transient: it may answer again
        ):
            return False
        if not h.is_actor(exc.actor_id):
            return False  # another actor died under this call
        if self._dead(h, type(exc).__name__) and not self._closing:
            log.warning("worker %s died and left its pool", h.worker_id)
        return True

    def stop_hung(self, h: WorkerHandle, silent_s: float) -> None:
        """`h` gave no load for `silent_s` (router/load_poll.py): it leaves its pool as
        a dead worker does (and is replaced, unless it was being removed), and its actor is
        killed (on the supervisor loop), which ends every call in flight there with Ray's actor
        error, so its requests resume elsewhere. Any thread."""
        with self.lock:
            if not h.up or self._closing:
                return  # found dead meanwhile, stopped, or all are being stopped
            self.hung.append(h.worker_id)
        log.error("worker %s gave no load for %.0f s (its engine stuck, its process stopped, "
                  "or its node unreachable): stopped, its requests resume elsewhere",
                  h.worker_id, silent_s)  # fmt: skip
        self.ops.submit(self._kill(h))  # ahead of its replacement, on the same loop
        self._dead(h, HUNG)

    async def _kill(self, h: WorkerHandle) -> None:
        try:
            ray.kill(h.actor, no_restart=True)
        except Exception as exc:  # Ray's own error; the pool has let it go either way
            log.warning("kill of %s failed: %s: %s", h.worker_id, type(exc).__name__, exc)

    def _dead(self, h: WorkerHandle, error: str) -> bool:
        """Take `h` out of its pool for good: True when that made it DEAD (a replacement then
        starts, unless --no-replace-dead-workers or closing); a worker being removed is STOPPED
        (False), one dead or stopped already stays so (False)."""
        with self.lock:
            if h.status in (WorkerStatus.DEAD, WorkerStatus.STOPPED):
                return False
            draining = h.status is WorkerStatus.DRAINING
            h.status = WorkerStatus.STOPPED if draining else WorkerStatus.DEAD
            h.error = error
            self.refresh_ids()
            if draining:
                return False
            self.dead.append(h.worker_id)
        if not self._closing:
            follow_up = self._replace if self.config.replace_dead else self._forget_dead
            self.ops.submit(follow_up(h))
        return True

    async def _forget_dead(self, dead: WorkerHandle) -> None:
        """No replacement (--no-replace-dead-workers): the dead worker leaves for good, with its
        pairs, here and on its peers."""
        await self.retire(dead, graceful=False)

    async def _replace(self, dead: WorkerHandle) -> None:
        """Start new incarnations under `dead`'s id until one is up (backing off between
        attempts), unless the id is replaced or removed by someone else meanwhile. One that
        hung, and one whose start failed, is started again on another node with room, if any:
        what stopped it there (a device held by a process that did not die, a node cut off
        from the router but not yet declared dead by Ray) may stop the next one too."""
        self.pairs.forget(dead.worker_id)
        backoff = self.config.restart_backoff_s
        # The nodes it hung on or failed to start on, kept out while another has room.
        avoid = {dead.node_id} if dead.error == HUNG and dead.node_id else set()
        while not self._closing and self._current(dead, WorkerStatus.DEAD):
            try:
                h = self._spawn(dead.role, dead.worker_id, dead.incarnation + 1, avoid)
            except Exception as exc:  # Ray refused the actor: try again after the backoff
                log.warning("replacing %s failed: %s: %s", dead.worker_id, type(exc).__name__, exc)
                await asyncio.sleep(backoff)
                backoff = min(60.0, backoff * 2)
                continue
            up = await self._engine_up(h)
            if not self._current(h, WorkerStatus.STARTING):
                return  # a resize removed it meanwhile
            if up:
                await self._pair_up(h)
                await self._warm(h)
                with self.lock:
                    if not self._current(h, WorkerStatus.STARTING):
                        return  # it died meanwhile (another replacement runs) or was removed
                    h.status = WorkerStatus.READY
                    self.restarts[h.role] += 1
                    self.refresh_ids()
                log.info("worker %s replaced (incarnation %d) and ready", h.worker_id,
                         h.incarnation)  # fmt: skip
                return
            self._stop_actor(h, WorkerStatus.DEAD)  # stays the current one: tried again
            dead = h
            if h.node_id:
                avoid.add(h.node_id)
            await asyncio.sleep(backoff)
            backoff = min(60.0, backoff * 2)

    def _current(self, h: WorkerHandle, status: WorkerStatus) -> bool:
        """Whether `h` is still its id's current incarnation, in `status`."""
        with self.lock:
            return self.workers.get(h.worker_id) is h and h.status is status

    async def retire(self, h: WorkerHandle, graceful: bool) -> None:
        """Stop a removed worker and take its pairs down on the peers."""
        if graceful:
            try:
                await within(h.actor.shutdown.remote(), self.config.control_timeout_s)
            except Exception:
                pass  # killed below either way
        self._stop_actor(h, WorkerStatus.STOPPED)
        self.pairs.forget(h.worker_id)
        self._drop(h)
        peers = [p for p in self.live() if p.role in PEERS[h.role]]
        timeout = self.config.control_timeout_s
        n = next(self._attempts)  # ends any attempt with it still running on a peer
        await asyncio.gather(
            *(within(p.actor.disconnect.remote(h.worker_id, n), timeout) for p in peers),
            return_exceptions=True,
        )

    # -- upkeep --------------------------------------------------------------------------------
    async def _maintain(self) -> None:
        """Keep every pair of READY workers made or scheduled, and retry broken ones when due."""
        while not self._closing:
            await asyncio.sleep(0.5)
            ready = [(w, r) for r in WorkerRole for w in self.ids[r]]
            for i, (a, ra) in enumerate(ready):
                for b, rb in ready[i + 1 :]:
                    if rb in PEERS[ra] and self.pairs.state(a, b) is None:
                        asyncio.ensure_future(self.pairs.pair(a, b))
            self.pairs.retry_due()

    def infos(self) -> list[WorkerInfo]:
        return [h.info for h in self.live() if h.info is not None]

    @property
    def closed(self) -> bool:
        """shutdown() was called: the pools take no request again."""
        return self._closing

    def shutdown(
        self, engines_wait_s: float = ENGINES_STOP_S, silent: Collection[str] = ()
    ) -> None:
        """Every engine asked to stop at once, `engines_wait_s` for all (a hung worker costs
        one wait, not one each; 0: none is asked), but those of the `silent` workers; the actors
        are killed after either way."""
        self._closing = True
        handles = self.handles()
        refs: list[Any] = []
        for h in handles:
            if engines_wait_s > 0 and h.info is not None and h.up and h.worker_id not in silent:
                with contextlib.suppress(Exception):  # already gone: killed below
                    refs.append(h.actor.shutdown.remote())
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=engines_wait_s)
        for h in handles:
            self._stop_actor(h, WorkerStatus.STOPPED)
        self.ops.stop()
