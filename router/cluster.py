"""Cluster: the two paths a request can take through the pools (router/pools.py).

Colocated: decode worker D prefills the prompt in chunks next to its running decodes and
streams tokens (a request of one token may be answered so by a prefill worker too: it
has nothing to decode).
Disaggregated: prefill worker P prefills it and streams its KV to D, which streams the tokens
(router/handoffs.py: the handoff, its fallbacks to D prefilling the prompt, and re-plans).
Either way, a request leaving early (or failing) is aborted for good on every worker it
touched; one whose D dies, stops, or cannot be reached resumes elsewhere (WorkerLost).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any

import ray

from engine.async_engine import EngineDeadError
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from kv_transfer import TransferStats
from router.cluster_config import ClusterConfig
from router.core_types import HandoffListener, NoWorkers, NullListener
from router.errors import WorkerLost
from router.handoffs import Handoffs
from router.load_poll import LoadPoll
from router.pools import ENGINES_STOP_S, Pools
from router.ray_runtime import init_ray
from router.request import PROMPT_LOGPROBS_COLOCATED
from router.resize import Resizes
from router.vocab import FallbackReason, Placement, RoutePath
from router.worker_calls import (
    GONE,
    UNAVAILABLE,
    abort_soon,
    hang_watch,
    lost,
    settle_abort,
    stream_of,
    why_gone,
)
from router.workers import WorkerHandle, WorkerStatus, within
from worker_protocol.messages import (
    TokenChunk,
    WorkerInfo,
    WorkerLoad,
    WorkerRole,
    WorkRequest,
)

log = logging.getLogger("pdserve.cluster")
SILENT_S = 10.0  # see Cluster.silent
STOP_SILENT_S = 2.0  # see Cluster.shutdown
STOP_PROBE_S = 2.0  # see Cluster.shutdown


class Cluster:
    def __init__(self, config: ClusterConfig, start: bool = True) -> None:
        """The pools' workers up (blocking), unless `start` is False: then `start()` brings
        them up, and `cancel_start()` (from another thread) stops a start still waiting."""
        self.config = config
        init_ray(config.address)
        self.pools = Pools(config.pool_config(ray.cluster_resources().get("GPU", 0.0)))
        self.resizes = Resizes(self.pools)
        self.handoffs = Handoffs(config, self.pools, lambda: self.prefill_ids)
        self._poll = LoadPoll(config.worker_hang_timeout_s)
        self._rr = itertools.count()
        if start:
            self.start()

    def start(self) -> None:
        """Bring the workers up (blocking); where they do not come up, or the start is
        cancelled, every worker started is stopped and PoolsUnavailable raised."""
        config = self.config
        try:
            self.pools.start(
                {
                    WorkerRole.PREFILL: config.num_prefill,
                    WorkerRole.DECODE: config.num_decode,
                    WorkerRole.BOTH: config.num_both,
                }
            )
        except BaseException:
            self.pools.shutdown()
            raise

    def cancel_start(self) -> None:
        """Stop a start still bringing the workers up: start() raises PoolsUnavailable."""
        self.pools.cancel_start()

    # -- the Backend the request core drives -----------------------------------------------------
    @property
    def prefill_ids(self) -> list[str]:
        """Workers that can prefill for a peer: prefill workers, then those that do both."""
        ids = self.pools.ids
        return ids[WorkerRole.PREFILL] + ids[WorkerRole.BOTH]

    @property
    def decode_ids(self) -> list[str]:
        """Workers that can decode: decode workers, then those that do both."""
        ids = self.pools.ids
        return ids[WorkerRole.DECODE] + ids[WorkerRole.BOTH]

    @property
    def fallbacks(self) -> deque[tuple[str, FallbackReason, str]]:
        """(request id, reason, detail) of the latest disaggregated requests prefilled on their
        decode worker (router/handoffs.py)."""
        return self.handoffs.fallbacks

    @property
    def replans(self) -> int:
        """Requests prefilled again on another prefill worker after one died."""
        return self.handoffs.replans

    @property
    def dead(self) -> list[str]:
        return self.pools.dead

    @property
    def hung(self) -> list[str]:
        return self.pools.hung

    @property
    def silent(self) -> set[str]:
        """Workers whose load calls have given no load for half the hang timeout (at most
        SILENT_S): new requests go elsewhere, where another worker can take them."""
        hang = self.config.worker_hang_timeout_s
        return self._poll.silent(min(SILENT_S, hang / 2) if hang > 0 else SILENT_S)

    @property
    def restarts(self) -> dict[WorkerRole, int]:
        return self.pools.restarts

    def worker_info(self, worker_id: str) -> WorkerInfo:
        info = self.pools.workers[worker_id].info
        if info is None:
            raise KeyError(f"{worker_id} is not up")
        return info

    def actor(self, worker_id: str) -> Any:
        """The Ray actor behind a worker id now."""
        return self.pools.workers[worker_id].actor

    def _pick(self, ids: Sequence[str]) -> str:
        return ids[next(self._rr) % len(ids)]

    def _decode_handle(self, worker_id: str | None) -> WorkerHandle:
        """The named decode worker, else the next of those up; NoWorkers where none is."""
        if worker_id:
            return self._handle(worker_id)
        ids = self.decode_ids
        if not ids:
            why = "the cluster is shut down" if self.pools.closed else "no decode worker is up"
            raise NoWorkers(f"{why}: no worker to decode the request")
        return self._handle(self._pick(ids))

    def _prefill_handle(self, worker_id: str | None, d: WorkerHandle) -> WorkerHandle | None:
        """The worker to prefill for D, or None when it (or, unnamed, every one but D) is
        gone."""
        if worker_id is None:
            ids = [w for w in self.prefill_ids if w != d.worker_id]
            return self.pools.workers.get(self._pick(ids)) if ids else None  # None: dropped
        h = self.pools.workers.get(worker_id)
        if h is None or not h.up or h is d:
            return None  # gone, or D itself (a worker does not hand KV to itself)
        return h

    def _handle(self, worker_id: str) -> WorkerHandle:
        h = self.pools.workers.get(worker_id)
        if h is None or not h.up:
            # Died (or was removed) since the request was placed; a replacement under the same
            # id may be starting, but takes no request before it is ready.
            raise WorkerLost(worker_id, "not in its pool")
        return h

    @property
    def closing(self) -> bool:
        """The server stops: a request ended early is answered before its aborts have gone
        through (which a stopped worker would hold to the control timeout); they go on alone."""
        return self.handoffs.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.handoffs.closing = value

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        placement: Placement,
        on_prefill: HandoffListener | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Stream one request's chunks. Leaving early (or failing) aborts it for good on every
        worker it touched, so its blocks are freed there and a call for it that Ray runs later
        does nothing: a request resumed after a worker died comes back under a new id
        (RequestBooks.moved). `on_prefill` hears how the handoff went on the disaggregated
        path. A caller's loop that may raise holds it in contextlib.aclosing: an `async for`
        does not close the generator it leaves by an exception, so the request would run on
        until the generator is collected (a traceback kept holds it). NoWorkers: no decode
        worker is up (the cluster is shut down, say). InvalidRequestError: prompt logprobs asked
        of the disaggregated path (they are computed where the prompt is, and a handoff's decode
        worker has none to give)."""
        if params.prompt_logprobs is not None and placement.path is RoutePath.DISAGGREGATED:
            raise InvalidRequestError("prompt_logprobs", PROMPT_LOGPROBS_COLOCATED)
        rid = placement.request_id
        req = WorkRequest(
            rid, tuple(int(t) for t in prompt_token_ids), params, placement.prefill_hold_s
        )
        d = self._decode_handle(placement.decode_worker)
        listener = on_prefill or NullListener()
        disaggregated = placement.path is RoutePath.DISAGGREGATED
        p = self._prefill_handle(placement.prefill_worker, d) if disaggregated else None
        # Counted first, then checked: a resize that marks a worker DRAINING after the check
        # waits for this request; one that did so before (the request was placed just before
        # it began, and its drain may find the worker idle) keeps it from starting there. A
        # leaving D sends it elsewhere; a leaving P leaves its prompt to D.
        d.active += 1
        if p is not None:
            p.active += 1  # until its handoff ends (Handoffs.run)
        if d.status is not WorkerStatus.READY:
            d.active -= 1
            if p is not None:
                p.active -= 1
            raise WorkerLost(d.worker_id, why_gone(d))
        gone = None
        if p is not None and p.status is not WorkerStatus.READY:
            p.active -= 1
            gone, p = f"{p.worker_id}: {why_gone(p)}", None
        # The ids it goes by on its workers: a reset on D (an abort before the router goes on
        # with it there) moves it to a new one, as a worker ignores an id it aborted
        # (worker_protocol/ended.py).
        ids = [rid]
        if p is not None:
            stream = self.handoffs.run(req, p, d, listener, placement.kv_due_in_s, ids)
        else:
            if disaggregated:  # its prefill worker left the pool on the way here
                why = (
                    gone or f"{placement.prefill_worker or 'no prefill worker'} is not in the pool"
                )
                self.handoffs.fallback(req, FallbackReason.NO_PREFILL_WORKER, why, 0.0, listener)
            watch = hang_watch(self.pools, d, self.config.worker_hang_timeout_s)
            stream = stream_of(d.actor.generate, req, watch=watch)
        finished = False
        try:
            async for chunk in stream:
                finished = chunk.finished
                yield chunk
        except GONE as exc:
            # D unreachable for now: its stream is broken whether or not D comes back (the
            # abort below is tried again until it lands), so the request goes on elsewhere too.
            unreachable = isinstance(exc, UNAVAILABLE) and d.is_actor(exc.actor_id)
            if not (lost(self.pools, d, exc) or unreachable):
                raise  # another actor died under this call
            why = (
                "its engine stopped"
                if isinstance(exc, EngineDeadError)
                else "unreachable (ActorUnavailableError)"
                if unreachable
                else type(exc).__name__
            )
            raise WorkerLost(d.worker_id, why) from exc
        finally:
            try:
                await stream.aclose()  # its hang watch ends with it
            finally:
                d.active -= 1
                if not finished:
                    await settle_abort(self._abort(ids, p, d), self.closing, self.pools.ops.submit)

    async def _abort(self, ids: list[str], p: WorkerHandle | None, d: WorkerHandle) -> None:
        """One try on each worker, at once; a worker unreachable for now gets the rest on the
        supervisor loop (worker_calls.abort_soon), so that the request goes on meanwhile."""
        handles = [d] + ([p] if p is not None else [])
        calls = [(h, rid) for h in handles for rid in ids]
        timeout, later = self.config.control_timeout_s, self.pools.ops.submit
        await asyncio.gather(*(abort_soon(h, rid, timeout, later) for h, rid in calls))

    # -- reading -----------------------------------------------------------------------------
    def set_step_target(
        self, worker_id: str, target_s: float | None, seq: int = 0
    ) -> Awaitable[None]:
        ref: Any = self._handle(worker_id).actor.set_step_target.remote(target_s, seq)  # sent now
        return within(ref, self.config.control_timeout_s)

    async def kv_stats(self) -> dict[str, TransferStats]:
        """Each live worker's KV transfer totals, by worker id."""
        items = self.pools.live()
        stats: list[TransferStats] = await within(
            asyncio.gather(*(h.actor.kv_stats.remote() for h in items)),
            self.config.control_timeout_s,
        )
        return {h.worker_id: s for h, s in zip(items, stats)}

    async def infos(self) -> list[WorkerInfo]:
        """What every live worker is (model shape, limits, measured device rates, node)."""
        return self.pools.infos()

    async def load(self, wait_s: float | None = None) -> list[WorkerLoad]:
        """Load figures of the live workers that answer within `wait_s` (None: the control
        timeout); a slow worker's call is left for the next call (router/load_poll.py). A worker
        found dead leaves its pool (and is replaced), as does one that answered none for
        --worker-hang-timeout, whose actor is killed."""
        wait = self.config.control_timeout_s if wait_s is None else wait_s
        polled = await self._poll.poll(self.pools.live(), wait)
        for h, exc in polled.failed:
            self.pools.note_failure(h, exc)
        for h, silent_s in polled.hung:
            self.pools.stop_hung(h, silent_s)
        return polled.loads

    # -- resize --------------------------------------------------------------------------------
    async def scale(
        self,
        num_prefill: int | None = None,
        num_decode: int | None = None,
        drain_timeout_s: float | None = None,
        num_both: int | None = None,
    ) -> None:
        """Resize the pools live (router/pools.py); returns once added workers take load and
        removed ones have stopped."""
        await self.pools.ops.run(
            self.resizes.scale(num_prefill, num_decode, drain_timeout_s, num_both)
        )

    def shutdown(self, engines_wait_s: float = ENGINES_STOP_S) -> None:
        """Stop every worker (Pools.shutdown), those that give no load (silent for STOP_SILENT_S
        already, or no answer within STOP_PROBE_S now) without waiting for their engines: a
        stopped or stuck one would hold the stop for all of `engines_wait_s`."""
        silent: set[str] = set()
        if engines_wait_s > 0:
            silent = self._poll.silent(STOP_SILENT_S)
            try:
                asked = [h for h in self.pools.live() if h.worker_id not in silent]
                silent |= self._poll.unanswering(asked, STOP_PROBE_S)
            except Exception as exc:  # no probe: the engines' own wait bounds the stop
                log.debug("the stop's load probe failed: %s: %s", type(exc).__name__, exc)
        if silent:
            log.info("%s gave no load within %g s of the stop: stopped without their engines' "
                     "own stop", ", ".join(sorted(silent)), STOP_PROBE_S)  # fmt: skip
        self.pools.shutdown(engines_wait_s, silent)
