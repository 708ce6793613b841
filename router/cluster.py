"""Cluster: the two paths a request can take through the pools (router/pools.py).

Colocated: decode worker D prefills the prompt in chunks next to its running decodes and
streams tokens.
Disaggregated, in order (DESIGN.md, request lifecycle):
  1. D reserves blocks for the prompt and starts receiving into those past its prefix-cache hit;
  2. prefill worker P prefills, streams the KV layer by layer, returns the first token, and
     frees its blocks once the send has ended;
  3. D joins the request to its batch with that token (or recomputes if the KV never came) and
     streams the rest.
A request never waits for a pair: when (P, D) is not connected, or D has no room to reserve,
or the prefill or its send fails, D prefills the prompt itself. Each such fallback is told to
the request's HandoffListener with its reason, and logged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import ray

from engine.async_engine import EngineDeadError
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from kv_transfer import TransferStats
from router.cluster_config import ClusterConfig
from router.core_types import HandoffListener
from router.errors import HandoffFailed, WorkerLost
from router.pools import Pools
from router.ray_runtime import init_ray
from router.vocab import FallbackReason, Placement, RoutePath
from router.workers import WorkerHandle, WorkerStatus
from worker_protocol.messages import (
    KVTarget,
    PrefillResult,
    TokenChunk,
    WorkerInfo,
    WorkerLoad,
    WorkerRole,
    WorkRequest,
)

log = logging.getLogger("pdserve.cluster")


class _NullListener:
    def prefilled(self, result: PrefillResult) -> None:
        pass

    def fell_back(self, reason: FallbackReason, detail: str, wasted_s: float) -> None:
        pass

    def replanned(self, dead: str, to: str, detail: str, wasted_s: float) -> None:
        pass


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        init_ray(config.address)
        self.pools = Pools(config.pool_config(ray.cluster_resources().get("GPU", 0.0)))
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
        # (request id, reason, detail) of the latest disaggregated requests prefilled on their
        # decode worker, and how many there were by reason.
        self.fallbacks: deque[tuple[str, FallbackReason, str]] = deque(maxlen=256)
        self.fallback_counts = {r: 0 for r in FallbackReason}
        self.replans = 0  # requests prefilled again on another prefill worker after one died
        self._rr = itertools.count()

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
    def dead(self) -> list[str]:
        return self.pools.dead

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

    def _prefill_handle(self, worker_id: str | None, d: WorkerHandle) -> WorkerHandle | None:
        """The worker to prefill for D, or None when it (or, unnamed, every one but D) is
        gone."""
        if worker_id is None:
            ids = [w for w in self.prefill_ids if w != d.worker_id]
            return self.pools.workers.get(self._pick(ids)) if ids else None  # None: dropped
        h = self.pools.workers.get(worker_id)
        if h is None or h.status not in (WorkerStatus.READY, WorkerStatus.DRAINING) or h is d:
            return None  # gone, or D itself (a worker does not hand KV to itself)
        return h

    def _handle(self, worker_id: str) -> WorkerHandle:
        h = self.pools.workers.get(worker_id)
        if h is None or h.status not in (WorkerStatus.READY, WorkerStatus.DRAINING):
            # Died (or was removed) since the request was placed; a replacement under the same
            # id may be starting, but takes no request before it is ready.
            raise WorkerLost(worker_id, "not in its pool")
        return h

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
        path."""
        rid = placement.request_id
        req = WorkRequest(
            rid, tuple(int(t) for t in prompt_token_ids), params, placement.prefill_hold_s
        )
        d = self._handle(placement.decode_worker or self._pick(self.decode_ids))
        listener = on_prefill or _NullListener()
        disaggregated = placement.path is RoutePath.DISAGGREGATED
        p = self._prefill_handle(placement.prefill_worker, d) if disaggregated else None
        # Counted first, then checked: a resize that marks a worker DRAINING after the check
        # waits for this request; one that did so before (the request was placed just before
        # it began, and its drain may find the worker idle) keeps it from starting there. A
        # leaving D sends it elsewhere; a leaving P leaves its prompt to D.
        d.active += 1
        if p is not None:
            p.active += 1  # until its handoff ends (_disaggregated)
        if d.status is not WorkerStatus.READY:
            d.active -= 1
            if p is not None:
                p.active -= 1
            raise WorkerLost(d.worker_id, _why_gone(d))
        gone = None
        if p is not None and p.status is not WorkerStatus.READY:
            p.active -= 1
            gone, p = f"{p.worker_id}: {_why_gone(p)}", None
        # The ids it goes by on its workers: a reset on D (an abort before the router goes on
        # with it there) moves it to a new one, as a worker ignores an id it aborted
        # (worker_protocol/ended.py).
        ids = [rid]
        if p is not None:
            stream = self._disaggregated(req, p, d, listener, placement.kv_due_in_s, ids)
        else:
            if disaggregated:  # its prefill worker left the pool on the way here
                why = (
                    gone or f"{placement.prefill_worker or 'no prefill worker'} is not in the pool"
                )
                self._fallback(req, FallbackReason.NO_PREFILL_WORKER, why, 0.0, listener)
            stream = self._stream(d.actor.generate, req)
        finished = unreachable = False
        try:
            async for chunk in stream:
                finished = chunk.finished
                yield chunk
        except _GONE as exc:
            # D unreachable for now: its stream is broken whether or not D comes back (the
            # abort below is retried until it lands), so the request goes on elsewhere too.
            unreachable = isinstance(exc, _UNAVAILABLE) and d.is_actor(exc.actor_id)
            if not (self._lost(d, exc) or unreachable):
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
            d.active -= 1
            if unreachable:  # tried until D answers, on the supervisor loop: the request
                self.pools.ops.submit(self._abort(ids, p, d))  # resumes meanwhile (new id)
            elif not finished:
                await asyncio.shield(self._abort(ids, p, d))

    def _lost(self, h: WorkerHandle, exc: BaseException) -> bool:
        """Whether `exc`, raised by a call to `h`, says `h` is gone: its actor died (it then
        leaves its pool: Pools.note_failure), or its engine stopped (a resize removed it as the
        call reached it). Either way its requests go on elsewhere."""
        return self.pools.note_failure(h, exc) or isinstance(exc, EngineDeadError)

    async def _abort(self, ids: list[str], p: WorkerHandle | None, d: WorkerHandle) -> None:
        handles = [d] + ([p] if p is not None else [])
        calls = [(h, rid) for h in handles for rid in ids]
        results = await asyncio.gather(*(self._abort_until(h, rid) for h, rid in calls))
        for (h, rid), r in zip(calls, results):
            # Gone (dead, or its engine stopped): nothing is left there to free.
            if r is not None and (isinstance(r, _UNAVAILABLE) or not isinstance(r, _GONE)):
                log.warning("abort of %s on %s failed: %s: %s", rid, h.worker_id,
                            type(r).__name__, r)  # fmt: skip

    async def _abort_until(self, h: WorkerHandle, rid: str) -> BaseException | None:
        """Abort `rid` on `h` within the control timeout: None once `h` answered, else what the
        last try raised. A worker unreachable for now (ActorUnavailableError) may still hold
        the request's blocks and come back: its abort is tried again every
        UNAVAILABLE_RETRY_S until the timeout."""
        deadline = time.monotonic() + self.config.control_timeout_s
        while True:
            try:
                left = max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(h.actor.abort.remote(rid), left)
                return None
            except _UNAVAILABLE as exc:
                if deadline - time.monotonic() < 2 * UNAVAILABLE_RETRY_S:  # no room for a try
                    return exc
                await asyncio.sleep(UNAVAILABLE_RETRY_S)
            except Exception as exc:
                return exc

    async def _stream(self, method: Any, *args: Any) -> AsyncIterator[TokenChunk]:
        gen = method.options(num_returns="streaming").remote(*args)
        async for ref in gen:
            yield await ref

    async def _disaggregated(
        self,
        req: WorkRequest,
        p: WorkerHandle,
        d: WorkerHandle,
        listener: HandoffListener,
        kv_due_in_s: float,
        ids: list[str],
    ) -> AsyncIterator[TokenChunk]:
        t0 = time.monotonic()
        fell: list[tuple[FallbackReason, str]] = []

        def fallback(reason: FallbackReason, detail: str) -> None:
            fell.append((reason, detail))
            self._fallback(req, reason, detail, time.monotonic() - t0, listener)

        try:  # P's drain waits for this request until here (counted in generate)
            handed = await self._handoff(req, p, d, fallback, listener, ids, kv_due_in_s)
        finally:
            p.active -= 1
        self._check_policy(fell)
        live = replace(req, request_id=ids[-1])  # after any reset on D, its new id
        if handed is None:  # nothing reserved on D: it prefills the prompt as a new request
            stream = self._stream(d.actor.generate, live)
        else:  # D joins it with P's first token, or recomputes it in the blocks it reserved
            stream = self._stream(d.actor.finish_handoff, live.request_id, *handed)
        async for chunk in stream:
            if chunk.kv_recomputed and not fell:  # P's send ended well, D's receive did not
                fallback(FallbackReason.TRANSFER_FAILED, f"the KV never reached {d.worker_id}")
                self._check_policy(fell)
            yield chunk

    def _check_policy(self, fell: list[tuple[FallbackReason, str]]) -> None:
        """Under --kv-failure-policy fail, a fallback ends the request (generate's cleanup then
        aborts it on both workers, which frees its blocks there)."""
        if fell and self.config.kv_failure_policy == "fail":
            reason, detail = fell[0]
            raise HandoffFailed(reason.value, detail)

    async def _handoff(
        self,
        req: WorkRequest,
        p: WorkerHandle,
        d: WorkerHandle,
        fallback: Callable[[FallbackReason, str], None],
        listener: HandoffListener,
        ids: list[str],
        kv_due_in_s: float = 0.0,
        replan: bool = True,
    ) -> tuple[int | None, TokenLogprobs | None] | None:
        """Steps 1-2: reserve on D (the KV expected no sooner than `kv_due_in_s`: Placement),
        prefill on P. Returns P's first token and its logprobs
        (None: D recomputes in its reserved blocks), or None when nothing was reserved on D.
        When P dies (mid-prefill or mid-transfer), the request is re-planned once onto another
        prefill worker paired with D, else D prefills it. A reset on D (an abort before going on
        there) appends the request's next id to `ids`, which it goes on under."""
        pairs, rid, t0 = self.pools.pairs, req.request_id, time.monotonic()
        if not pairs.connected(p.worker_id, d.worker_id):
            st = pairs.state(p.worker_id, d.worker_id)
            failed = st is not None and st.failures > 0
            reason = FallbackReason.PAIRING_FAILED if failed else FallbackReason.PAIR_NOT_READY
            fallback(reason, pairs.why_not(p.worker_id, d.worker_id))
            return None
        timeout = self.config.control_timeout_s
        try:
            target: KVTarget | None = await asyncio.wait_for(
                d.actor.reserve_kv.remote(req, p.worker_id, kv_due_in_s), timeout
            )
        except _GONE:
            raise  # D died or its engine stopped: the request resumes on another (generate)
        except Exception as exc:  # D did not answer in time: what it may have reserved goes
            await self._abort_on(d, rid)
            _renew(ids)  # D prefills it under a new id
            fallback(FallbackReason.NO_RESERVATION, f"{d.worker_id}: {type(exc).__name__}: {exc}")
            return None
        if target is None:
            fallback(FallbackReason.NO_RESERVATION, f"{d.worker_id} had no free blocks or slot")
            return None
        limit = self.config.prefill_timeout_s + self.config.kv_transfer_deadline_s
        try:
            result: PrefillResult = await asyncio.wait_for(
                p.actor.prefill.remote(req, d.worker_id, target.dst_block_ids, target.skip_blocks),
                limit,
            )
        except Exception as exc:  # P died, timed out or failed
            died = self._lost(p, exc)
            if isinstance(exc, _UNAVAILABLE):  # tried until P answers; D prefills meanwhile
                self.pools.ops.submit(self._abort_on(p, rid))
            elif not died:
                await self._abort_on(p, rid)  # it may still be prefilling: stop it
            why = f"{p.worker_id} -> {d.worker_id}: {type(exc).__name__}: {exc}"
            other = self._replan_onto(p, d) if died and replan else None
            if other is None:
                fallback(FallbackReason.PREFILL_FAILED, why)
                return None, None
            # Re-planned: D's reservation was for P's KV; it is made again for the other's, under
            # a new id, once D has surely dropped the first (else D prefills it, as without a
            # re-plan). Counted on the other first: a drain of it waits for this request.
            other.active += 1
            try:
                # Else D prefills it as a new request, under a new id: where the abort may
                # still land there (it frees the reservation late), or a resize began to
                # remove the other meanwhile.
                stay = None
                if not await self._abort_on(d, rid):
                    stay = why
                elif other.status is not WorkerStatus.READY:
                    stay = f"{why}; {other.worker_id}: {_why_gone(other)}"
                if stay is not None:
                    fallback(FallbackReason.PREFILL_FAILED, stay)
                    _renew(ids)
                    return None
                again = replace(req, request_id=_renew(ids))
                log.warning("request %s: %s; prefilling again on %s", rid, why, other.worker_id)
                self.replans += 1
                listener.replanned(p.worker_id, other.worker_id, why, time.monotonic() - t0)
                try:
                    # Counts on D at once: the other worker's queue was never predicted.
                    return await self._handoff(
                        again, other, d, fallback, listener, ids, replan=False
                    )
                except BaseException:  # cancelled (the client left): stop its prefill too
                    await asyncio.shield(self._abort_on(other, again.request_id))
                    raise
            finally:
                other.active -= 1
        listener.prefilled(result)
        if result.first_token is None:
            fallback(FallbackReason.PREFILL_FAILED, f"{p.worker_id}: {result.error}")
        elif not result.transfer_ok:
            why = f"{p.worker_id} -> {d.worker_id}: {result.error}"
            fallback(FallbackReason.TRANSFER_FAILED, why)
            self.pools.ops.submit(self._check_pair(p, d))
        return result.first_token, result.first_logprobs

    def _replan_onto(self, dead: WorkerHandle, d: WorkerHandle) -> WorkerHandle | None:
        """The least busy other prefill worker taking load and paired with D, if any."""
        ready = [
            h for w in self.prefill_ids
            if w not in (dead.worker_id, d.worker_id)
            and (h := self.pools.workers.get(w)) is not None  # dropped meanwhile
            and h.status is WorkerStatus.READY
            and self.pools.pairs.connected(w, d.worker_id)
        ]  # fmt: skip
        return min(ready, key=lambda h: h.active, default=None)

    async def _abort_on(self, h: WorkerHandle, rid: str) -> bool:
        """Abort `rid` on one worker, for good (it then ignores a call for `rid` that Ray runs
        after the abort); False when it did not answer in time (or failed)."""
        exc = await self._abort_until(h, rid)
        if exc is not None:
            log.warning("abort of %s on %s failed: %s: %s", rid, h.worker_id,
                        type(exc).__name__, exc)  # fmt: skip
        return exc is None

    async def _check_pair(self, p: WorkerHandle, d: WorkerHandle) -> None:
        """(Supervisor loop.) After a failed transfer: if either side lost the pair, it is made
        again in the background; requests between the two prefill locally meanwhile."""
        try:
            ok = all(
                await asyncio.wait_for(
                    asyncio.gather(
                        p.actor.connected.remote(d.worker_id),
                        d.actor.connected.remote(p.worker_id),
                    ),
                    self.config.control_timeout_s,
                )
            )
        except Exception:
            ok = False
        if not ok:
            self.pools.pairs.lost(p.worker_id, d.worker_id, "a transfer failed")

    def _fallback(
        self,
        req: WorkRequest,
        reason: FallbackReason,
        detail: str,
        wasted_s: float,
        listener: HandoffListener,
    ) -> None:
        """A disaggregated request that the decode worker prefills itself: told and logged."""
        self.fallbacks.append((req.request_id, reason, detail))
        self.fallback_counts[reason] += 1
        listener.fell_back(reason, detail, wasted_s)
        log.warning(
            "request %s: %s (%s); prefilling on the decode worker",
            req.request_id, reason.value, detail,
        )  # fmt: skip

    # -- reading -----------------------------------------------------------------------------
    def set_step_target(
        self, worker_id: str, target_s: float | None, seq: int = 0
    ) -> Awaitable[None]:
        ref: Any = self._handle(worker_id).actor.set_step_target.remote(target_s, seq)  # sent now
        return asyncio.wait_for(ref, self.config.control_timeout_s)

    async def kv_stats(self) -> dict[str, TransferStats]:
        """Each live worker's KV transfer totals, by worker id."""
        items = self.pools.live()
        stats: list[TransferStats] = await asyncio.wait_for(
            asyncio.gather(*(h.actor.kv_stats.remote() for h in items)),
            self.config.control_timeout_s,
        )
        return {h.worker_id: s for h, s in zip(items, stats)}

    async def infos(self) -> list[WorkerInfo]:
        """What every live worker is (model shape, limits, measured device rates, node)."""
        return self.pools.infos()

    async def load(self) -> list[WorkerLoad]:
        """Load figures of every live worker that answers within the control timeout; a worker
        found dead leaves its pool (and is replaced)."""
        items = self.pools.live()
        timeout = self.config.control_timeout_s
        loads = await asyncio.gather(
            *(asyncio.wait_for(h.actor.load.remote(), timeout) for h in items),
            return_exceptions=True,
        )
        out: list[WorkerLoad] = []
        for h, ld in zip(items, loads):
            if isinstance(ld, WorkerLoad):
                out.append(ld)
            elif isinstance(ld, BaseException):
                self.pools.note_failure(h, ld)
        return out

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
            self.pools.scale(num_prefill, num_decode, drain_timeout_s, num_both)
        )

    def shutdown(self) -> None:
        self.pools.shutdown()


# What a call to a worker raises when the worker is gone: its actor died, or its engine stopped.
# Among those, what it raises while the worker cannot be reached for now (it may come back).
_GONE = (ray.exceptions.RayActorError, EngineDeadError)
_UNAVAILABLE = ray.exceptions.ActorUnavailableError
UNAVAILABLE_RETRY_S = 0.5  # between tries of an abort on a worker unreachable for now


def _why_gone(h: WorkerHandle) -> str:
    return "it is leaving its pool" if h.status is WorkerStatus.DRAINING else "not in its pool"


def _renew(ids: list[str]) -> str:
    """The next id a request goes by on its workers after a reset; appended to `ids`."""
    ids.append(f"{ids[0]}.{len(ids)}")
    return ids[-1]
