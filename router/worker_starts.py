"""How a worker joins the pools (router/pools.py builds their lifecycle on this), and the book of
members those steps keep.

  spawn     the actor of one incarnation is created, placed by its pool's Placement on the
            node spread_node chooses (router/workers.py);
  engine    its engine comes up within the start timeout, and it runs the router's own code
            (worker_protocol/code_id.py), else it does not start and its error says why in one
            line;
  pairs     it is paired with every peer whose engine is up (PEERS; router/pairing.py keeps
            the pairs): one end listens, both connect;
  warm-up   it runs a warm-up request (one that fails still leaves it serving).

`lock` guards the handles' statuses, `workers` and `ids` for both; readers on other threads take
snapshots under it (`ids` lists are replaced whole, never changed in place).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
from collections.abc import Collection
from typing import Any

import ray

from both_worker.worker import BothWorker
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from router.cluster_config import PoolConfig
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
from worker_protocol.messages import WorkerRole

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


class WorkerStarts:
    """The pools' members (the current incarnation of each id, the READY ids by role) and the
    steps that bring one up. Pools (router/pools.py) adds what changes membership over time."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.ops = LoopThread()
        self.pairs = PairBook(self._connect, timeout_s=config.pair_timeout_s)
        self.workers: dict[str, WorkerHandle] = {}  # the current incarnation of each id
        self.ids: dict[WorkerRole, list[str]] = {r: [] for r in WorkerRole}  # READY, by role
        self._next = {r: itertools.count() for r in WorkerRole}
        # Pairing calls carry their attempt's number (kv_transfer/torch_dist.py: a late call of
        # an attempt given up on is refused rather than undoing a newer one).
        self._attempts = itertools.count(1)
        self.lock = threading.RLock()

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

    # -- one worker's start --------------------------------------------------------------------
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

    def _stop_actor(self, h: WorkerHandle, status: WorkerStatus) -> None:
        with self.lock:
            h.status = status
            self.refresh_ids()
        try:
            ray.kill(h.actor, no_restart=True)
        except Exception:
            pass  # already gone


def _listens_first(a: WorkerHandle, b: WorkerHandle) -> bool:
    """Whether `a`, rather than `b`, listens when the two pair."""
    if a.role is not b.role:
        return a.role is WorkerRole.DECODE or b.role is WorkerRole.PREFILL
    return order(a.worker_id) < order(b.worker_id)
