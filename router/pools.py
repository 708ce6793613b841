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
saw it does. `lock` guards the handles' statuses, `workers` and `ids` for both; readers on other
threads take snapshots under it (`ids` lists are replaced whole, never changed in place).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import re
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import ray

from both_worker.worker import BothWorker
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from router.pairing import PairBook
from router.workers import (
    LoopThread,
    Placement,
    WorkerHandle,
    WorkerStatus,
    order,
    spread_node,
    within,
)
from worker_protocol.code_id import ROUTER_CODE_ARG, code_id, other_code, refused_at_start
from worker_protocol.messages import WorkerInfo, WorkerRole, WorkerSpec

log = logging.getLogger("pdserve.pools")
ACTOR_CLASSES: dict[WorkerRole, type] = {
    WorkerRole.PREFILL: PrefillWorker,
    WorkerRole.DECODE: DecodeWorker,
    WorkerRole.BOTH: BothWorker,
}
# The roles a worker of each role is paired with (KV can go between them one way or the other).
PEERS = {
    WorkerRole.PREFILL: frozenset({WorkerRole.DECODE, WorkerRole.BOTH}),
    WorkerRole.DECODE: frozenset({WorkerRole.PREFILL, WorkerRole.BOTH}),
    WorkerRole.BOTH: frozenset(WorkerRole),
}
Counts = dict[WorkerRole, int]
HUNG = "hung"  # the error of a worker stopped for giving no load (stop_hung)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    spec: WorkerSpec
    placement: dict[WorkerRole, Placement] = field(default_factory=dict)
    start_timeout_s: float = 300.0  # an actor placed, its engine up and warm
    control_timeout_s: float = 30.0  # a control call to a worker
    pair_timeout_s: float = 10.0  # one pairing attempt
    replace_dead: bool = True
    restart_backoff_s: float = 2.0  # after a replacement that failed to start; doubles to 60 s
    drain_timeout_s: float = 30.0  # a removed worker's own requests, before it is stopped
    max_workers: int = 64  # of all pools together, after a resize (ClusterConfig.max_workers)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the actor's name in its errors


def start_failure(exc: BaseException) -> str:
    """Why a worker did not start, in one line: what its constructor raised (the last line of
    the traceback Ray quotes; `--log-level debug` logs it whole), else the error itself."""
    text = _ANSI.sub("", str(exc))
    if "raised in its creation task" in text:
        last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
        if "KVCacheAllocationError" in last and "cpu_kv_cache_gib" in last:
            last += " (serve sets it with --kv-cache-gib)"
        return f"its start raised {last}"
    return f"{type(exc).__name__}: {text}"


class PoolsUnavailable(RuntimeError):
    """Workers did not come up (placement, resources, a failing engine); the message says why."""


class Pools:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.ops = LoopThread()
        self.pairs = PairBook(self._connect, timeout_s=config.pair_timeout_s)
        self.workers: dict[str, WorkerHandle] = {}  # the current incarnation of each id
        self.ids: dict[WorkerRole, list[str]] = {r: [] for r in WorkerRole}  # READY, by role
        self.dead: list[str] = []  # ids of workers found dead, in the order found
        # Workers stopped for answering no load poll (in `dead` too, unless being removed).
        self.hung: list[str] = []
        self.restarts: dict[WorkerRole, int] = {r: 0 for r in WorkerRole}
        self._next = {r: itertools.count() for r in WorkerRole}
        # Pairing calls carry their attempt's number (kv_transfer/torch_dist.py: a late call of
        # an attempt given up on is refused rather than undoing a newer one).
        self._attempts = itertools.count(1)
        self.lock = threading.RLock()
        self._closing = False
        self._starting: concurrent.futures.Future[list[WorkerHandle]] | None = None
        self._start_cancelled = False
        self._maintainer = self.ops.submit(self._maintain())

    # -- reading -------------------------------------------------------------------------------
    def handles(self) -> list[WorkerHandle]:
        """Every current handle, whatever its status (a snapshot)."""
        with self.lock:
            return list(self.workers.values())

    def live(self) -> list[WorkerHandle]:
        """Workers whose engine is up and not stopped: READY and DRAINING."""
        return [h for h in self.handles() if h.up]

    def holds(self, h: WorkerHandle) -> bool:
        """Whether `h` is still its id's incarnation, up (it leaves once found dead or hung, or
        stopped by a resize)."""
        return self.workers.get(h.worker_id) is h and h.up

    def refresh_ids(self) -> None:
        with self.lock:
            for role in WorkerRole:  # a new list each time: readers elsewhere see whole ones
                self.ids[role] = sorted(
                    (w for w, h in self.workers.items() if h.role is role and h.ready), key=order
                )

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

    def _new_id(self, role: WorkerRole) -> str:
        while True:
            wid = f"{role.value}-{next(self._next[role])}"
            if wid not in self.workers:
                return wid

    def _spawn(
        self,
        role: WorkerRole,
        worker_id: str,
        incarnation: int = 0,
        avoid: Collection[str] = (),
    ) -> WorkerHandle:
        """Create the actor of one incarnation, on the node spread_node chooses (none of
        `avoid` while another has room)."""
        placement = self.config.placement.get(role, Placement())
        nodes = ray.nodes()
        node = spread_node(placement, nodes, self.handles(), self.config.placement, avoid)
        where = next((n["NodeManagerAddress"] for n in nodes if n["NodeID"] == node), None)
        if where is None:
            log.warning("starting %s (incarnation %d): no node has room for it now (it asks "
                        "for %s); Ray places it once one has", worker_id, incarnation,
                        placement.describe())  # fmt: skip
        else:
            log.info("starting %s (incarnation %d) on %s", worker_id, incarnation, where)
        cls: Any = ray.remote(ACTOR_CLASSES[role])
        actor = cls.options(**placement.actor_options(node)).remote(
            worker_id, self.config.spec, incarnation, **{ROUTER_CODE_ARG: code_id()}
        )
        handle = WorkerHandle(worker_id, role, actor, incarnation, node)
        with self.lock:
            self.workers[worker_id] = handle
        return handle

    def _drop(self, h: WorkerHandle) -> None:
        with self.lock:
            if self.workers.get(h.worker_id) is h:
                del self.workers[h.worker_id]
            self.refresh_ids()

    async def _engine_up(self, h: WorkerHandle) -> bool:
        """Wait (bounded) for the actor's engine; keep what it says about itself."""
        try:
            h.info = await within(h.actor.ready.remote(), self.config.start_timeout_s)
        except TimeoutError:
            placement = self.config.placement.get(h.role, Placement())
            h.error = (
                f"not up within {self.config.start_timeout_s:.0f} s; each {h.role.value} worker "
                f"asks Ray for {placement.describe()}: check that the cluster has them "
                f"(`ray status`)"
            )
        except Exception as exc:
            h.error = refused_at_start(str(exc)) or start_failure(exc)
            log.debug("worker %s (incarnation %d) did not start: %s", h.worker_id, h.incarnation,
                      _ANSI.sub("", str(exc)))  # fmt: skip
        else:
            h.node_id = h.node_id or h.info.node_id or None  # where Ray placed it, if it chose
            h.error = await self._code_error(h)
            if h.error is None:
                return True
        if h.status is WorkerStatus.STOPPED:  # a resize removed it as it started
            log.info("worker %s (incarnation %d) stopped as it started", h.worker_id,
                     h.incarnation)  # fmt: skip
        else:
            log.warning("worker %s (incarnation %d) did not start: %s", h.worker_id,
                        h.incarnation, h.error)  # fmt: skip
        return False

    async def _code_error(self, h: WorkerHandle) -> str | None:
        """Why a worker whose engine is up cannot serve with this router (None: it can)."""
        try:
            theirs = await self._code_of(h)
        except TimeoutError:  # the control call's wait, not the start's
            return (
                f"its engine is up, but it did not say which code it runs within "
                f"{self.config.control_timeout_s:g} s (the control timeout)"
            )
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if theirs == code_id() else other_code(theirs)

    async def _code_of(self, h: WorkerHandle) -> str | None:
        """The code the worker runs (worker_protocol/code_id.py); None: a version from before
        the check (its actor has no such method: Ray's call fails on its side)."""
        try:
            call: Any = h.actor.code_id.remote()
            return str(await within(call, self.config.control_timeout_s))
        except (AttributeError, ray.exceptions.RayTaskError):
            return None

    async def _pair_up(self, h: WorkerHandle) -> None:
        """Pair a new worker with every peer (PEERS) whose engine is up."""
        peers = [
            p for p in self.handles()
            if p.role in PEERS[h.role] and p is not h and p.info is not None
            and p.status in (WorkerStatus.STARTING, WorkerStatus.READY)
        ]  # fmt: skip
        await asyncio.gather(*(self.pairs.pair(h.worker_id, p.worker_id) for p in peers))

    async def _warm(self, h: WorkerHandle) -> None:
        try:
            await within(h.actor.warmup.remote(), self.config.start_timeout_s)
        except Exception as exc:  # it still serves; its first request pays for the warm-up
            if h.status is not WorkerStatus.STOPPED:  # (not: a resize removed it meanwhile)
                log.warning("warm-up of %s failed: %s: %s", h.worker_id, type(exc).__name__,
                            exc)  # fmt: skip

    async def _connect(self, a: str, b: str) -> None:
        """Make the pair of `a` and `b`: both ends first drop what is left of an earlier one and
        end the attempts before this one (one that timed out may still be running there), then
        one listens (a dedicated decode worker, else the other end's peer that is not a
        dedicated prefill worker, else the lower id) and both connect."""
        ah, bh = self.workers[a], self.workers[b]
        n = next(self._attempts)
        await asyncio.gather(ah.actor.disconnect.remote(b, n), bh.actor.disconnect.remote(a, n))
        if _listens_first(bh, ah):
            ah, bh = bh, ah
        address = await ah.actor.listen.remote(bh.worker_id, n)
        await asyncio.gather(
            ah.actor.connect.remote(bh.worker_id, address, True, n),
            bh.actor.connect.remote(ah.worker_id, address, False, n),
        )

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

    def _stop_actor(self, h: WorkerHandle, status: WorkerStatus) -> None:
        with self.lock:
            h.status = status
            self.refresh_ids()
        try:
            ray.kill(h.actor, no_restart=True)
        except Exception:
            pass  # already gone

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

    def shutdown(self) -> None:
        self._closing = True
        handles = self.handles()
        # Every engine asked to stop at once, 10 s for all (a hung worker costs one wait, not
        # one each); the actors are killed after either way.
        refs: list[Any] = []
        for h in handles:
            if h.info is not None and h.up:
                with contextlib.suppress(Exception):  # already gone: killed below
                    refs.append(h.actor.shutdown.remote())
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=10)
        for h in handles:
            self._stop_actor(h, WorkerStatus.STOPPED)
        self.ops.stop()


def _listens_first(a: WorkerHandle, b: WorkerHandle) -> bool:
    """Whether `a`, rather than `b`, listens when the two pair."""
    if a.role is not b.role:
        return a.role is WorkerRole.DECODE or b.role is WorkerRole.PREFILL
    return order(a.worker_id) < order(b.worker_id)
