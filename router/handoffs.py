"""A disaggregated request's handoff between its prefill worker P and its decode worker D, in
order (DESIGN.md, request lifecycle):
  1. D reserves blocks for the prompt and starts receiving into those past its prefix-cache hit;
  2. P prefills, streams the KV layer by layer, returns the first token, and frees its blocks
     once the send has ended;
  3. D joins the request to its batch with that token (or recomputes if the KV never came) and
     streams the rest.
A request never waits for a pair: when (P, D) is not connected, or D has no room to reserve, or
the prefill or its send fails, D prefills the prompt itself. Each such fallback is told to the
request's HandoffListener with its reason, counted and logged. When P dies, the prompt is
prefilled again once on another prefill worker paired with D. When D leaves (found dead or
hung, or stopped by a resize) while P prefills, the request resumes elsewhere at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from engine.errors import InvalidRequestError
from engine.token_logprobs import TokenLogprobs
from router.cluster_config import ClusterConfig
from router.core_types import HandoffListener
from router.errors import HandoffFailed, WorkerLost
from router.pools import Pools
from router.vocab import FallbackReason
from router.worker_calls import (
    GONE,
    abort_soon,
    hang_watch,
    lost,
    renew,
    settle_abort,
    stream_of,
    why_gone,
)
from router.workers import WorkerHandle, WorkerStatus, done_unless, within
from worker_protocol.messages import KVTarget, PrefillResult, TokenChunk, WorkRequest

log = logging.getLogger("pdserve.cluster")
T = TypeVar("T")
WATCH_S = 0.2  # how often a handoff in flight looks whether its decode worker is still there


class Handoffs:
    def __init__(
        self, config: ClusterConfig, pools: Pools, prefill_ids: Callable[[], list[str]]
    ) -> None:
        self.config, self.pools, self._prefill_ids = config, pools, prefill_ids
        # (request id, reason, detail) of the latest disaggregated requests prefilled on their
        # decode worker, and how many there were by reason.
        self.fallbacks: deque[tuple[str, FallbackReason, str]] = deque(maxlen=256)
        self.fallback_counts = {r: 0 for r in FallbackReason}
        self.replans = 0  # requests prefilled again on another prefill worker after one died
        self.closing = False  # Cluster.closing

    async def run(
        self,
        req: WorkRequest,
        p: WorkerHandle,
        d: WorkerHandle,
        listener: HandoffListener,
        kv_due_in_s: float,
        ids: list[str],
    ) -> AsyncGenerator[TokenChunk, None]:
        t0 = time.monotonic()
        fell: list[tuple[FallbackReason, str]] = []

        def fallback(reason: FallbackReason, detail: str) -> None:
            fell.append((reason, detail))
            self.fallback(req, reason, detail, time.monotonic() - t0, listener)

        try:  # P's drain waits for this request until here (counted in generate)
            handed = await self._handoff(req, p, d, fallback, listener, ids, kv_due_in_s)
        finally:
            p.active -= 1
        if not self.pools.holds(d):  # it left meanwhile: no use going on with it there
            raise WorkerLost(d.worker_id, why_gone(d))
        self._check_policy(fell)
        live = replace(req, request_id=ids[-1])  # after any reset on D, its new id
        watch = hang_watch(self.pools, d, self.config.worker_hang_timeout_s)
        if handed is None:  # nothing reserved on D: it prefills the prompt as a new request
            stream = stream_of(d.actor.generate, live, watch=watch)
        else:  # D joins it with P's first token, or recomputes it in the blocks it reserved
            stream = stream_of(d.actor.finish_handoff, live.request_id, *handed, watch=watch)
        async with contextlib.aclosing(stream):  # its hang watch ends with it
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
            target: KVTarget | None = await within(
                d.actor.reserve_kv.remote(req, p.worker_id, kv_due_in_s), timeout
            )
        except GONE:
            raise  # D died or its engine stopped: the request resumes on another (generate)
        except InvalidRequestError:
            # The request's own fault (an empty prompt, a token id out of the vocabulary, a
            # prompt of the whole context), raised by D's engine before it reserved anything
            # (Ray's RayTaskError is an instance of it): D prefilling it would refuse it too.
            raise
        except Exception as exc:  # D did not answer in time: what it may have reserved goes
            await self._abort_on(d, rid)
            renew(ids)  # D prefills it under a new id
            fallback(FallbackReason.NO_RESERVATION, f"{d.worker_id}: {type(exc).__name__}: {exc}")
            return None
        if target is None:
            fallback(FallbackReason.NO_RESERVATION, f"{d.worker_id} had no free blocks or slot")
            return None
        limit = self.config.prefill_timeout_s + self.config.kv_transfer_deadline_s
        try:
            dst, skip = target.dst_block_ids, target.skip_blocks
            call = p.actor.prefill.remote(req, d.worker_id, dst, skip)
            result: PrefillResult = await self._while_there(d, within(call, limit))
        except WorkerLost:
            raise  # D left: the request resumes elsewhere (P's prefill is aborted by generate)
        except Exception as exc:  # P died, timed out or failed
            died = lost(self.pools, p, exc)
            if not died:
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
                    stay = f"{why}; {other.worker_id}: {why_gone(other)}"
                if stay is not None:
                    fallback(FallbackReason.PREFILL_FAILED, stay)
                    renew(ids)
                    return None
                again = replace(req, request_id=renew(ids))
                log.warning("request %s: %s; prefilling again on %s", rid, why, other.worker_id)
                self.replans += 1
                listener.replanned(p.worker_id, other.worker_id, why, time.monotonic() - t0)
                try:
                    # Counts on D at once: the other worker's queue was never predicted.
                    return await self._handoff(
                        again, other, d, fallback, listener, ids, replan=False
                    )
                except BaseException:  # cancelled (the client left): stop its prefill too
                    abort = self._abort_on(other, again.request_id)
                    await settle_abort(abort, self.closing, self.pools.ops.submit)
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

    async def _while_there(self, d: WorkerHandle, work: Awaitable[T]) -> T:
        """`work`'s result, unless D leaves first (found dead or hung, or stopped at the end of
        a resize's drain): WorkerLost then, at once rather than once P's prefill and send have
        failed against it (the transfer deadline), and the request resumes elsewhere."""
        task = asyncio.ensure_future(work)
        try:
            if not await done_unless(task, lambda: not self.pools.holds(d), WATCH_S):
                raise WorkerLost(d.worker_id, why_gone(d))
            return task.result()
        finally:
            task.cancel()

    def _replan_onto(self, dead: WorkerHandle, d: WorkerHandle) -> WorkerHandle | None:
        """The least busy other prefill worker taking load and paired with D, if any."""
        ready = [
            h for w in self._prefill_ids()
            if w not in (dead.worker_id, d.worker_id)
            and (h := self.pools.workers.get(w)) is not None  # dropped meanwhile
            and h.status is WorkerStatus.READY
            and self.pools.pairs.connected(w, d.worker_id)
        ]  # fmt: skip
        return min(ready, key=lambda h: h.active, default=None)

    async def _abort_on(self, h: WorkerHandle, rid: str) -> bool:
        """Abort `rid` on one worker, for good: one try within the control timeout, the rest on
        the supervisor loop while it is unreachable (worker_calls.abort_soon, which logs a
        failure); False when it did not answer (or failed)."""
        timeout = self.config.control_timeout_s
        return await abort_soon(h, rid, timeout, self.pools.ops.submit) is None

    async def _check_pair(self, p: WorkerHandle, d: WorkerHandle) -> None:
        """(Supervisor loop.) After a failed transfer: if either side lost the pair, it is made
        again in the background; requests between the two prefill locally meanwhile."""
        try:
            ok = all(
                await within(
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

    def fallback(
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
