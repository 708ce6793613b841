"""The request core: every front door (gRPC, HTTP) hands it a checked request and relays what it
yields. One request, in order:
  1. the policy picks the path and the workers (router/policy.py);
  2. admission (router/admission.py) takes it, or refuses it at once (Overloaded) when the
     queue is full or waiting would make it miss its TTFT SLO; the decision is logged and kept;
  3. the pools run it (router/cluster.py) where the decision placed it; its books
     (router/books.py, over the workers' books in router/worker_books.py) follow it from queued
     prefill to decoding to done, so the next decision sees it at once, and settle it in one
     place however it ends;
  4. chunks stream back with text (router/placement_steps.py); the first one's arrival is the
     TTFT the client sees, and it trains the per-path bias and the prediction-error record; the
     last carries a summary.
Leaving early (client cancel or deadline) closes the stream, which aborts the request on every
worker it touched. A background task polls the workers' load and feeds their step times to the
cost model.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import AsyncGenerator, Collection, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from engine.prefix_hash import block_hashes
from engine.text_stream import TextStream
from router.admission import RetrySpread, TtftMargin, group_refusal, refusal
from router.books import RequestBooks, RequestCounts
from router.core_types import Backend, CoreChunk, NoWorkers, RouterConfig
from router.endings import Endings
from router.errors import WorkerLost
from router.handoff_model import HandoffHealth, TransferTimeModel
from router.membership import Membership
from router.placement_steps import PlacementSteps
from router.policy import Decision, Planner, RequestShape
from router.pool_state import WorkerState
from router.request import ParsedRequest
from router.stats import NullSink, StatsSink
from router.step_target import StepTargets
from router.target_calls import TargetCalls
from router.tracker import Tracker
from router.vocab import Frontend, RejectReason, RoutePath
from worker_protocol.messages import WorkerInfo

log = logging.getLogger("pdserve.router")
MAX_RESUMES = 2  # a request outliving this many lost workers (that streamed it) fails


class RequestCore(PlacementSteps):
    def __init__(
        self,
        backend: Backend,
        infos: Sequence[WorkerInfo],
        config: RouterConfig,
        tokenizer: Any,
        sink: StatsSink | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.sink = sink or NullSink()
        self.config = config
        self.block_size = infos[0].block_size
        self.transfer = TransferTimeModel()
        self.health = HandoffHealth()
        self.members = Membership(backend, infos, self.health, self.sink)
        self.states = self.members.states  # the books, by worker id (current incarnations)
        self.planner = Planner(config.policy, self.transfer, self.health)
        self.step_targets = StepTargets() if config.tune_step_target else None
        self.target_calls = None
        if self.step_targets is not None:
            self.planner.target_for = self.step_targets.for_request
            self.target_calls = TargetCalls(backend, self.members, self.step_targets)
        self.records = deque(maxlen=2048)
        self.margin = TtftMargin()  # admission's, from the first tokens (planner.ttft_margin)
        self.planner.rate_admission = config.decode_rate_admission
        self.counts = RequestCounts()
        self.spread = RetrySpread()  # decode_rate refusals' retry hints
        self.endings = Endings()  # the streams in flight, to end when the server stops
        self._poller: asyncio.Task[None] | None = None
        self._ids = itertools.count()  # workers see internal ids: clients' ids may collide

    @property
    def pending(self) -> int:
        """Admitted requests still waiting for their first token."""
        return self.counts.pending

    @property
    def active(self) -> int:
        """Admitted requests not yet finished."""
        return self.counts.active

    @property
    def resumed(self) -> int:
        """Times a request moved to another decode worker."""
        return self.counts.resumed

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a worker mid-restart: keep the last figures
                log.warning("load poll failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.config.poll_interval_s)

    async def refresh(self) -> None:
        self.members.absorb(await self.backend.load(self.config.poll_wait_s))
        _, decode = self.members.pools()
        widths = {("ttft", ""): self.planner.ttft_spread.width}
        widths.update((("itl_p99", s.worker_id), s.measured.itl_spread.width) for s in decode)
        self.sink.spreads(widths)
        if self.target_calls is not None and self.target_calls.targets.due():
            await self.target_calls.retarget()

    # -- one request -------------------------------------------------------------------------
    def plan(self, req: ParsedRequest) -> tuple[RequestShape, Decision]:
        slo_ttft_s = (req.slo_ttft_ms / 1000) if req.slo_ttft_ms else self.config.slo_ttft_s
        shape = RequestShape(
            prompt_len=len(req.prompt_token_ids),
            hashes=self._hashes(req, req.prompt_token_ids, 0),
            max_tokens=req.sampling.max_tokens,
            slo_ttft_s=slo_ttft_s,
            slo_itl_s=(req.slo_itl_ms / 1000) if req.slo_itl_ms else self.config.slo_itl_s,
            prefill_hold_s=self._hold(slo_ttft_s, 0.0),
        )
        prefill, decode = self._without(*self.members.pools(), self.backend.silent)
        if not decode:
            self.sink.rejected(RejectReason.NO_WORKERS, req.frontend)
            raise NoWorkers("no decode worker is up; the server cannot take requests now")
        path, why = _path(req, 0)
        return shape, self.planner.decide(shape, prefill, decode, path, why=why)

    def _hashes(self, req: ParsedRequest, ids: tuple[int, ...], emitted: int) -> tuple[bytes, ...]:
        """The prompt's block hashes, for the prefix caches' hits; none where its prompt
        logprobs are asked for (their positions are computed: it takes no hit)."""
        if req.asks_prompt_logprobs(emitted):
            return ()
        return tuple(block_hashes(ids, self.block_size))

    @staticmethod
    def _without(
        prefill: list[WorkerState], decode: list[WorkerState], out: Collection[str]
    ) -> tuple[list[WorkerState], list[WorkerState]]:
        """The pools without the workers in `out` (silent for a while: Backend.silent; or lost
        but still in its pool), as they are where that would leave no worker that decodes."""
        if not out:
            return prefill, decode
        kept = [w for w in decode if w.worker_id not in out]
        if not kept:
            return prefill, decode
        return [w for w in prefill if w.worker_id not in out], kept

    def _hold(self, slo_ttft_s: float, since_arrival_s: float) -> float | None:
        """How long a request's prompt may wait for decodes where it is prefilled (Placement
        prefill_hold_s): the hold share of its TTFT SLO, less what it spent since it arrived;
        None without a share (each worker's own hold)."""
        share = self.config.prefill_hold_share
        return None if share is None else max(0.0, share * slo_ttft_s - since_arrival_s)

    def room_for(self, n: int, frontend: Frontend) -> None:
        """Raise Overloaded (counted once) when the queue has no room for `n` requests that
        stand or fall together (admission.group_refusal); each is admitted on its own after."""
        refused = group_refusal(n, self.config, self.counts)
        if refused is not None:
            self.sink.rejected(refused.reason, frontend)
            raise refused

    def _admit(self, shape: RequestShape, decision: Decision, frontend: Frontend) -> None:
        """Raise Overloaded (counted by its reason) when the request is refused."""
        refused = refusal(
            shape, decision, self.config, self.counts, self.planner.ttft_margin, self.spread
        )
        if refused is not None:
            self.sink.rejected(refused.reason, frontend)
            raise refused

    async def generate(self, req: ParsedRequest, arrived: float) -> AsyncGenerator[CoreChunk, None]:
        """Run one admitted request; raises Overloaded before any work is done. If its decode
        worker dies, leaves its pool or cannot be reached (WorkerLost), it resumes on another
        from its prompt and the tokens already streamed (greedy output is unchanged, and so is a
        seeded sample's: the new worker draws from the next sample's number on: engine/sampler.py
        explains)."""
        live = self.endings.open()  # end_all ends it (the server stopping), or refuses it now
        try:
            shape, decision = self.plan(req)
            self._admit(shape, decision, req.frontend)
            self.planner.demand.arrived(shape.prompt_len, shape.max_tokens)  # taken
            text = TextStream(self.tokenizer, req.prompt_token_ids, req.sampling)
            with self._books(req, decision, arrived) as books:  # settled however it ends
                try:
                    for attempt in range(MAX_RESUMES + 1):
                        try:
                            placed = self._placed(req, shape, decision, books, text)
                            async with aclosing(placed) as chunks:
                                async for chunk in chunks:
                                    live.yielding()
                                    yield chunk
                                    if chunk.final is not None:
                                        return  # answered: nothing is left to end
                                    live.resumed()
                            return
                        except WorkerLost as lost:
                            if attempt == MAX_RESUMES or not self.backend.decode_ids:
                                raise
                            shape, decision = self._resumed(req, shape, books, lost)
                except asyncio.CancelledError:
                    ended = live.cancelled()
                    if ended is None:
                        raise  # its reader left
                    raise ended from None
        finally:
            self.endings.close(live)

    def _books(self, req: ParsedRequest, decision: Decision, arrived: float) -> RequestBooks:
        path = decision.chosen.path.value
        self.sink.decided(path, decision.reason_code)
        track = Tracker(
            req.request_id,
            arrived,
            path,
            req.frontend,
            len(req.prompt_token_ids),
            decision.chosen.ttft_s,
        )
        wid = f"{req.request_id}#{next(self._ids)}"
        return RequestBooks(wid, track, decision, self.counts, self.records, self.states, self.sink)

    def _resumed(
        self, req: ParsedRequest, shape: RequestShape, books: RequestBooks, lost: WorkerLost
    ) -> tuple[RequestShape, Decision]:
        """Its decode worker was lost (died, stopped, leaving its pool, or unreachable for now):
        it leaves that placement, and is planned again from its prompt and the tokens already
        streamed."""
        emitted = books.emitted
        log.warning("request %s: %s; resuming after %d tokens", req.request_id, lost, len(emitted))
        books.moved()
        ids = req.prompt_token_ids + tuple(emitted)
        shape = replace(
            shape,
            prompt_len=len(ids),
            hashes=self._hashes(req, ids, len(emitted)),
            max_tokens=req.sampling.max_tokens - len(emitted),
            # Tokens streamed already: a wait for decodes would be a gap in its stream; else
            # what its first placement took counts against its hold.
            prefill_hold_s=(
                0.0
                if emitted
                else self._hold(shape.slo_ttft_s, time.monotonic() - books.track.arrived)
            ),
        )
        # A worker lost but still in its pool (unreachable for now: it may come back) is left
        # out of this plan, as silent ones are, unless no other could decode it.
        pools = self._without(*self.members.pools(), self.backend.silent)
        prefill, decode = self._without(*pools, {lost.worker_id})
        path, why = _path(req, len(emitted))
        return shape, self.planner.decide(shape, prefill, decode, path, admitting=False, why=why)

    # -- reading -----------------------------------------------------------------------------
    def prediction_error(self, path: RoutePath | None = None, last: int = 200) -> float | None:
        """Median |predicted - measured| / measured TTFT over the latest requests (of `path`)."""
        errs = [
            abs(r.decision.chosen.ttft_s - r.measured_ttft_s) / r.measured_ttft_s
            for r in list(self.records)[-last:]
            if r.measured_ttft_s and (path is None or r.decision.chosen.path is path)
        ]
        return statistics.median(errs) if errs else None


def _path(req: ParsedRequest, emitted: int) -> tuple[RoutePath, str]:
    """The path a request asks for, and who asks: its prompt logprobs, until its first token
    (they come with it), are computed where its prompt is, on the colocated path."""
    if req.asks_prompt_logprobs(emitted):
        return RoutePath.COLOCATED, "prompt_logprobs"
    return req.path, "override"
