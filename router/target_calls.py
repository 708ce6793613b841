"""The step target calls of one router (router/step_target.py says how targets are chosen):
each worker's new target sent, numbered, and recorded once the worker took it.

Two kinds: every retarget (RequestCore.refresh, from the gaps its requests saw), and at each
placement the decode worker's target brought down to the new request's ITL SLO (tighten).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Awaitable

from router.core_types import Backend
from router.membership import Membership
from router.pool_state import WorkerState
from router.step_target import StepTargets
from router.workers import within

log = logging.getLogger("pdserve.router")


class TargetCalls:
    def __init__(self, backend: Backend, members: Membership, targets: StepTargets) -> None:
        self.backend = backend
        self.members = members
        self.targets = targets
        # Calls made at placement, in flight, by worker (one each; see tighten).
        self.tightening: dict[str, asyncio.Future[None]] = {}
        # The tightest ITL SLO asked of a worker while its call was in flight: sent once it ends.
        self.tighten_next: dict[str, float] = {}
        self._sent = itertools.count(1)  # numbers the calls
        self._latest: dict[str, int] = {}  # by worker: the number of the latest sent

    async def retarget(self) -> None:
        """Tune each worker's step target from the tail of the gaps its requests see."""
        _, decode = self.members.pools()
        moves = [(s, t) for s in decode if (t := self.targets.retarget(s)) is not None]
        await self.set_targets(moves, "ITL p99 at the router")

    def tighten(self, decode_worker: str, slo_itl_s: float) -> None:
        """Bring the step target of the worker a request will decode on down to its ITL SLO
        (StepTargets.for_request). Not awaited: the call goes ahead of the request's own calls
        to that worker, and the request waits for no engine step; one call per worker at a
        time (a failed one is logged, and the next request placed there tries again). A request
        placed while a call is in flight was predicted under the target it asks for: the
        tightest asked meanwhile goes once the call ends."""
        if decode_worker in self.tightening:
            waiting = self.tighten_next.get(decode_worker, math.inf)
            self.tighten_next[decode_worker] = min(waiting, slo_itl_s)
            return
        state = self.members.state(decode_worker)
        target = self.targets.for_request(state, slo_itl_s)
        if target is None:
            return
        why = f"a request's ITL SLO {slo_itl_s * 1000:.0f} ms"
        call = self._send_target(decode_worker, target)  # sent now
        task = asyncio.ensure_future(self.set_targets([(state, target)], why, [call]))
        self.tightening[decode_worker] = task
        task.add_done_callback(lambda _: self._tightened(decode_worker))

    def _tightened(self, decode_worker: str) -> None:
        self.tightening.pop(decode_worker, None)
        waiting = self.tighten_next.pop(decode_worker, None)
        if waiting is not None:
            self.tighten(decode_worker, waiting)

    def _send_target(self, worker_id: str, target_s: float) -> Awaitable[int]:
        """The backend's call, numbered (rising with each one sent), or its failure to leave (a
        worker just gone), to be awaited; it gives the call's number."""
        n = next(self._sent)
        self._latest[worker_id] = n
        try:
            call = self.backend.set_step_target(worker_id, target_s, n)
        except Exception as exc:
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            call = failed

        async def numbered() -> int:
            await call
            return n

        return numbered()

    async def set_targets(
        self,
        moves: list[tuple[WorkerState, float]],
        why: str,
        calls: list[Awaitable[int]] | None = None,
    ) -> None:
        """Send each worker its new target (unless `calls` already did) and record those that
        took it within 5 s, unless a newer one was sent there meanwhile (it records itself: the
        worker ignores an older one that Ray runs after it, Cluster.set_step_target)."""
        if calls is None:
            calls = [self._send_target(s.worker_id, t) for s, t in moves]
        done = await asyncio.gather(*(within(c, 5.0) for c in calls), return_exceptions=True)
        for (state, target), res in zip(moves, done):
            if isinstance(res, BaseException):  # a worker mid-restart: tried again later
                log.warning("step target of %s not set: %s: %s", state.worker_id,
                            type(res).__name__, res)  # fmt: skip
                continue
            if res != self._latest.get(state.worker_id):
                continue
            log.info("step target of %s: %.0f -> %.0f ms (%s)",
                     state.worker_id, (state.model.step_target_s or 0) * 1000,
                     target * 1000, why)  # fmt: skip
            state.model.step_target_s = target
            self.targets.changed(state.worker_id)
