"""The request core: every front door (gRPC, HTTP) hands it a checked request and relays what it
yields. One request, in order:
  1. the policy picks the path and the workers (router/policy.py);
  2. admission (router/admission.py) takes it, or refuses it at once (Overloaded) when the
     queue is full or waiting would make it miss its TTFT SLO; the decision is logged and kept;
  3. the pools run it (router/cluster.py) where the decision placed it; its books
     (router/books.py, over the workers' books in router/worker_books.py) follow it from queued
     prefill to decoding to done, so the next decision sees it at once, and settle it in one
     place however it ends;
  4. chunks stream back with text; the first one's arrival is the TTFT the client sees, and it
     trains the per-path bias and the prediction-error record; the last carries a summary.
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
from router.core_types import Backend, CoreChunk, DecisionRecord, NoWorkers, RouterConfig, Summary
from router.endings import Endings
from router.errors import WorkerLost
from router.handoff import Handoff
from router.handoff_model import HandoffHealth, TransferTimeModel
from router.membership import Membership
from router.policy import Decision, PathPrediction, Planner, RequestShape
from router.pool_state import WorkerState
from router.refusal_log import Said
from router.request import ParsedRequest
from router.stats import NullSink, StatsSink
from router.step_target import StepTargets
from router.target_calls import TargetCalls
from router.tracker import Tracker
from router.vocab import FinishReason, Frontend, Placement, RejectReason, RoutePath
from worker_protocol.messages import TokenChunk, WorkerInfo

log = logging.getLogger("pdserve.router")
_CUT_SHORT = Said(log, logging.WARNING)  # answers the KV cache cut short
MAX_RESUMES = 2  # a request outliving this many dead decode workers fails
# A handoff's KV is expected on its decode worker no sooner than this share of its predicted
# TTFT (Placement.kv_due_in_s): until then that worker runs its own prompts at the whole budget
# rather than in chunks sized for a landing decode, and does not hold them for its decode. On
# the benchmark traces 2% of handoffs had their first token sooner than 0.4 of its prediction.
KV_DUE_SHARE = 0.4


def _cached(req: ParsedRequest, chunk: TokenChunk, track: Tracker) -> int:
    """Its prompt tokens whose KV was not computed for it: the hit of the worker that prefilled
    it (a handoff's prefill worker, else the worker that streams it), at most its prompt (a
    resumed request's prompt there holds its output so far)."""
    hit = chunk.num_cached_tokens if track.prefiller_cached is None else track.prefiller_cached
    return min(hit, len(req.prompt_token_ids))


class RequestCore:
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
        self.sink: StatsSink = sink or NullSink()
        self.config = config
        self.block_size = infos[0].block_size
        self.transfer = TransferTimeModel()
        self.health = HandoffHealth()
        self.members = Membership(backend, infos, self.health, self.sink)
        self.states = self.members.states  # the books, by worker id (current incarnations)
        self.planner = Planner(config.policy, self.transfer, self.health)
        self.step_targets = StepTargets() if config.tune_step_target else None
        self.target_calls: TargetCalls | None = None
        if self.step_targets is not None:
            self.planner.target_for = self.step_targets.for_request
            self.target_calls = TargetCalls(backend, self.members, self.step_targets)
        self.records: deque[DecisionRecord] = deque(maxlen=2048)
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
            hashes=tuple(block_hashes(req.prompt_token_ids, self.block_size)),
            max_tokens=req.sampling.max_tokens,
            slo_ttft_s=slo_ttft_s,
            slo_itl_s=(req.slo_itl_ms / 1000) if req.slo_itl_ms else self.config.slo_itl_s,
            prefill_hold_s=self._hold(slo_ttft_s, 0.0),
        )
        prefill, decode = self._without(*self.members.pools(), self.backend.silent)
        if not decode:
            self.sink.rejected(RejectReason.NO_WORKERS, req.frontend)
            raise NoWorkers("no decode worker is up; the server cannot take requests now")
        return shape, self.planner.decide(shape, prefill, decode, req.path)

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
            self.planner.demand.arrived(shape.prompt_len, shape.max_tokens)  # taken: it decodes
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

    async def _placed(
        self,
        req: ParsedRequest,
        shape: RequestShape,
        decision: Decision,
        books: RequestBooks,
        text: TextStream,
    ) -> AsyncGenerator[CoreChunk, None]:
        """One placement's chunks, booked and detokenized, up to the last (with its summary)."""
        chosen = decision.chosen
        self._log_decision(req.request_id, shape, decision)
        p, d = books.place(shape, chosen)
        if self.target_calls is not None:
            self.target_calls.tighten(chosen.decode_worker, shape.slo_itl_s)
        handoff = Handoff(
            books.track, books.wid, chosen, p, d, self.transfer, self.health, self.sink
        )
        async with aclosing(self._run(req, shape, chosen, books, handoff)) as stream:
            async for chunk in stream:
                if books.took(chunk):
                    self._trained(req.request_id, books.first, books.track, shape.slo_ttft_s)
                delta = text.feed(chunk.token_ids, chunk.finished)
                final = None
                if chunk.finished or text.stop_hit is not None:
                    final = self._summary(req, books.first, chosen, chunk, text, books.track)
                    books.finished(
                        final.finish_reason, final.cached_prompt_tokens, final.length_reason
                    )
                    if final.length_reason is not None:
                        _CUT_SHORT.say(time.monotonic(), "request %s cut short after %d of its "
                                       "%d tokens: %s (on %s; --kv-cache-gib sizes the cache)",
                                       req.request_id, final.completion_tokens,
                                       req.sampling.max_tokens, final.length_reason,
                                       final.decode_worker)  # fmt: skip
                    self.planner.demand.ended(books.track.output_tokens, req.sampling.max_tokens)
                yield CoreChunk(req.request_id, chunk.token_ids, delta, chunk.logprobs, final)
                if final is not None:
                    return  # closing the stream aborts a worker still running it
        raise RuntimeError(f"the stream of {req.request_id} ended before it finished")

    def _run(
        self,
        req: ParsedRequest,
        shape: RequestShape,
        chosen: PathPrediction,
        books: RequestBooks,
        handoff: Handoff,
    ) -> AsyncGenerator[TokenChunk, None]:
        """The backend stream for one placement; after a resume, prompt + tokens so far."""
        params, emitted = req.sampling, books.emitted
        if emitted:  # its samples so far were drawn on the worker it leaves
            params = replace(
                params, max_tokens=params.max_tokens - len(emitted), drawn=len(emitted)
            )
        placement = Placement(
            path=chosen.path,
            request_id=books.wid,
            prefill_worker=chosen.prefill_worker or None,
            decode_worker=chosen.decode_worker,
            # The models' TTFT where a pair's failure risk raised the prediction (a handoff that
            # goes through is no later for it).
            kv_due_in_s=(
                KV_DUE_SHARE * min(chosen.ttft_s, chosen.raw_ttft_s)
                if chosen.prefill_worker
                else 0.0
            ),
            prefill_hold_s=shape.prefill_hold_s,
        )
        return self.backend.generate(
            req.prompt_token_ids + tuple(emitted), params, placement, handoff
        )

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
            hashes=tuple(block_hashes(ids, self.block_size)),
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
        return shape, self.planner.decide(shape, prefill, decode, req.path, admitting=False)

    def _summary(
        self,
        req: ParsedRequest,
        first: Decision,
        chosen: PathPrediction,
        chunk: TokenChunk,
        text: TextStream,
        track: Tracker,
    ) -> Summary:
        stopped = text.stop_hit is not None
        ended = FinishReason(chunk.finish_reason) if chunk.finish_reason else None
        # A string with a LENGTH finish is no stop string: what cut it (the engine's KV cache).
        cut = ended is FinishReason.LENGTH and isinstance(chunk.stop_reason, str)
        return Summary(
            finish_reason=FinishReason.STOP if stopped else ended,
            stop_reason=text.stop_hit if stopped else None if cut else chunk.stop_reason,
            length_reason=str(chunk.stop_reason) if cut and not stopped else None,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=track.output_tokens,
            cached_prompt_tokens=_cached(req, chunk, track),
            path=chosen.path,  # the placement that finished it (the first, unless resumed)
            prefill_worker=track.replanned_to or chosen.prefill_worker,
            decode_worker=chosen.decode_worker,
            ttft_s=track.ttft_s or 0.0,
            decision=first,
            kv_fallback=track.kv_fallback,
            resumed=track.resumed,
        )

    def _log_decision(self, rid: str, shape: RequestShape, decision: Decision) -> None:
        c = decision.chosen
        log.info(
            "request %s -> %s %s%s: %s | %d prompt tokens, %d uncached; predicted TTFT %.0f ms "
            "(queue %.0f, prefill %.0f, transfer %.0f), ITL %.1f ms, running ITL %.1f ms",
            rid,
            c.path.value,
            c.prefill_worker + "->" if c.prefill_worker else "",
            c.decode_worker,
            decision.reason,
            shape.prompt_len,
            c.uncached_tokens,
            c.ttft_s * 1000,
            c.queue_s * 1000,
            c.prefill_s * 1000,
            c.transfer_s * 1000,
            c.itl_s * 1000,
            c.running_itl_s * 1000,
        )

    def _trained(self, rid: str, decision: Decision, track: Tracker, slo_ttft_s: float) -> None:
        """The first token is out: keep the decision with its measured TTFT, and train the
        path's bias and the spread of TTFT predictions (unless a failed handoff made the decode
        worker prefill after all, or it was replanned or resumed: its first token then came
        from another placement than the one predicted)."""
        ttft = track.ttft_s or 0.0
        disturbed = bool(track.kv_fallback or track.replanned_to or track.resumed)
        self.records.append(DecisionRecord(rid, decision, ttft, disturbed))
        if not disturbed:
            self.planner.ttft_margin = self.margin.observe(decision.chosen.ttft_s, ttft, slo_ttft_s)
        self.sink.first_token(track.first_token())
        chosen = decision.chosen
        if not disturbed and (chosen.path is RoutePath.COLOCATED or track.handed_off):
            self.planner.bias[chosen.path].observe(chosen.raw_ttft_s, ttft)
            self.planner.ttft_spread.observe(chosen.ttft_s, ttft, slo_ttft_s)

    # -- reading -----------------------------------------------------------------------------
    def prediction_error(self, path: RoutePath | None = None, last: int = 200) -> float | None:
        """Median |predicted - measured| / measured TTFT over the latest requests (of `path`)."""
        errs = [
            abs(r.decision.chosen.ttft_s - r.measured_ttft_s) / r.measured_ttft_s
            for r in list(self.records)[-last:]
            if r.measured_ttft_s and (path is None or r.decision.chosen.path is path)
        ]
        return statistics.median(errs) if errs else None
