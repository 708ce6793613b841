"""The request core: every front door (gRPC, HTTP) hands it a checked request and relays what it
yields. One request, in order:
  1. admission: refused at once (Overloaded) when the queue of requests still waiting for their
     first token is full, or when the chosen path's predicted TTFT, times how late first tokens
     have come against their predictions lately (the margin), misses the request's TTFT SLO
     and waiting would help (the predicted queue time is what pushes it over); a request that
     misses its SLO on idle workers is served anyway;
  2. the policy picks the path and the workers (router/policy.py); the decision is logged with
     its inputs and kept;
  3. the pools run it (router/cluster.py); the core's books (router/pool_state.py) follow the
     request from queued prefill to decoding to done, so the next decision sees it at once;
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
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from dataclasses import replace
from typing import Any

from engine.prefix_hash import block_hashes
from engine.text_stream import TextStream
from router.core_types import (
    Backend,
    CoreChunk,
    DecisionRecord,
    NoWorkers,
    Overloaded,
    RouterConfig,
    Summary,
)
from router.cost_model import HandoffHealth, TransferTimeModel, prefill_pairs
from router.errors import WorkerLost
from router.handoff import Handoff
from router.membership import Membership
from router.policy import Decision, PathPrediction, Planner, RequestShape
from router.pool_state import WorkerState
from router.request import ParsedRequest
from router.stats import NullSink, StatsSink
from router.tracker import Tracker
from router.vocab import RoutePath
from worker_protocol.messages import TokenChunk, WorkerInfo

log = logging.getLogger("pdserve.router")
MAX_RESUMES = 2  # a request outliving this many dead decode workers fails
# The admission margin: a quantile of measured / predicted TTFT over the latest first tokens.
MARGIN_WINDOW, MARGIN_MIN_SAMPLES, MARGIN_QUANTILE, MARGIN_MAX = 64, 16, 0.9, 4.0


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
        self.records: deque[DecisionRecord] = deque(maxlen=2048)
        self.pending = 0
        self.active = 0
        self.resumed = 0  # times a request moved to another decode worker
        self.ttft_margin = 1.0  # admission's factor on predicted TTFT (see ttft_margin())
        self._poller: asyncio.Task[None] | None = None
        self._ids = itertools.count()  # workers see internal ids: clients' ids may collide

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
        self.members.absorb(await self.backend.load())

    # -- one request -------------------------------------------------------------------------
    def plan(self, req: ParsedRequest) -> tuple[RequestShape, Decision]:
        shape = RequestShape(
            prompt_len=len(req.prompt_token_ids),
            hashes=tuple(block_hashes(req.prompt_token_ids, self.block_size)),
            max_tokens=req.sampling.max_tokens,
            slo_ttft_s=(req.slo_ttft_ms / 1000) if req.slo_ttft_ms else self.config.slo_ttft_s,
            slo_itl_s=(req.slo_itl_ms / 1000) if req.slo_itl_ms else self.config.slo_itl_s,
        )
        prefill, decode = self.members.pools()
        if not decode:
            self.sink.rejected("no_workers")
            raise NoWorkers("no decode worker is up; the server cannot take requests now")
        return shape, self.planner.decide(shape, prefill, decode, req.path)

    def _admit(self, shape: RequestShape, decision: Decision) -> None:
        c = self.config
        if self.pending >= c.max_pending or self.active >= c.max_active:
            wait = max(0.05, decision.chosen.queue_s)
            raise Overloaded(
                "queue_full",
                f"server busy: {self.pending} requests wait for a first token "
                f"(limit {c.max_pending}), {self.active} are active (limit {c.max_active})",
                wait,
            )
        chosen, margin = decision.chosen, self.ttft_margin
        if chosen.ttft_s * margin > shape.slo_ttft_s and chosen.queue_s > 0:
            raise Overloaded(
                "slo",
                f"predicted TTFT {chosen.ttft_s * 1000:.0f} ms (x {margin:.2f}, how late first "
                f"tokens have come lately) exceeds the TTFT SLO {shape.slo_ttft_s * 1000:.0f} ms "
                f"({chosen.queue_s * 1000:.0f} ms of it queueing)",
                # the queue to drain before it would pass
                min(chosen.queue_s, chosen.ttft_s - shape.slo_ttft_s / margin),
            )

    async def generate(self, req: ParsedRequest, arrived: float) -> AsyncGenerator[CoreChunk, None]:
        """Run one admitted request; raises Overloaded before any work is done. If its decode
        worker dies, it resumes on another from its prompt and the tokens already streamed
        (greedy output is unchanged; a seeded sample continues with a fresh generator)."""
        shape, decision = self.plan(req)
        try:
            self._admit(shape, decision)
        except Overloaded as exc:
            self.sink.rejected(exc.reason)
            raise
        rid = req.request_id
        wid = f"{rid}#{next(self._ids)}"
        first = decision  # the decision the client is told about
        path = first.chosen.path.value
        self.sink.decided(path, first.reason_code)
        track = Tracker(rid, arrived, path, len(req.prompt_token_ids), first.chosen.ttft_s)
        text = TextStream(self.tokenizer, req.prompt_token_ids, req.sampling)
        self.pending += 1
        self.active += 1
        emitted: list[int] = []
        placed: list[WorkerState] = []
        failed = True
        try:
            for attempt in range(MAX_RESUMES + 1):
                chosen = decision.chosen
                self._log_decision(rid, shape, decision)
                prefill_on, d = self._place(wid, shape, chosen)
                placed += [prefill_on, d]
                if _late(track, shape):  # resumed after missing its TTFT SLO
                    d.unprotect(wid)
                handoff = Handoff(
                    track, wid, chosen, prefill_on, d, self.transfer, self.health, self.sink
                )
                stream = self._run(req, wid, chosen, emitted, handoff)
                try:
                    async for chunk in stream:
                        if self._first_token_of(wid, track, chunk, prefill_on, d, shape):
                            self.pending -= 1
                            self._trained(rid, first, track)
                            if _late(track, shape):
                                d.unprotect(wid)  # it cannot attain: it guards no one's ITL
                        emitted.extend(chunk.token_ids)
                        d.grow(wid, len(chunk.token_ids))
                        delta = text.feed(chunk.token_ids, chunk.finished)
                        done = chunk.finished or text.stop_hit is not None
                        final = None
                        if done:
                            final = self._summary(req, first, chosen, chunk, text, track)
                            track.ended(final.finish_reason, chunk.num_cached_tokens)
                            failed = False
                        yield CoreChunk(rid, chunk.token_ids, delta, chunk.logprobs, final)
                        if done:
                            return  # closing the stream aborts a worker still running it
                    raise RuntimeError(f"the stream of {rid} ended before it finished")
                except WorkerLost as lost:
                    if attempt == MAX_RESUMES or not self.backend.decode_ids:
                        raise
                    log.warning("request %s: %s; resuming after %d tokens", rid, lost, len(emitted))
                    track.resumed += 1
                    self.resumed += 1
                    prefill_on.finish(wid)
                    d.finish(wid)
                    ids = req.prompt_token_ids + tuple(emitted)
                    shape = replace(
                        shape,
                        prompt_len=len(ids),
                        hashes=tuple(block_hashes(ids, self.block_size)),
                        max_tokens=req.sampling.max_tokens - len(emitted),
                    )
                    prefill, decode = self.members.pools()
                    decision = self.planner.decide(shape, prefill, decode, req.path)
                finally:
                    await _close(stream)
        except (GeneratorExit, asyncio.CancelledError):
            failed = False  # the client left (or its deadline passed): an abort, not a failure
            raise
        finally:
            if track.first_at is None:
                self.pending -= 1
                self.records.append(DecisionRecord(rid, first, None))
            self.active -= 1
            for w in placed:
                w.finish(wid)
            self.sink.finished(track.record(failed))

    def _run(
        self,
        req: ParsedRequest,
        wid: str,
        chosen: PathPrediction,
        emitted: list[int],
        handoff: Handoff,
    ) -> AsyncIterator[TokenChunk]:
        """The backend stream for one placement; after a resume, prompt + tokens so far."""
        params = req.sampling
        if emitted:
            params = replace(params, max_tokens=params.max_tokens - len(emitted))
        return self.backend.generate(
            req.prompt_token_ids + tuple(emitted),
            params,
            "disaggregated" if chosen.path is RoutePath.DISAGGREGATED else "colocated",
            wid,
            chosen.prefill_worker or None,
            chosen.decode_worker,
            handoff,
        )

    def _first_token_of(
        self,
        wid: str,
        track: Tracker,
        chunk: TokenChunk,
        prefill_on: WorkerState,
        d: WorkerState,
        shape: RequestShape,
    ) -> bool:
        """Book a chunk; True when it brings the request's very first token."""
        if chunk.token_ids and prefill_on is d and not d.decoding(wid):
            d.done(wid)  # colocated: prefilled here; decoding from now on
            d.add_decode(wid, shape.prompt_len, shape.slo_itl_s)
            if _late(track, shape):  # resumed after missing its TTFT SLO
                d.unprotect(wid)
        elif chunk.token_ids and d.prefilling(wid):
            d.done(wid)  # a disaggregated request prefilled here after a fallback
        was_first = track.first_at is None
        gaps = track.chunk(chunk)
        if chunk.token_ids:
            self.sink.streamed(track.path, len(chunk.token_ids), gaps)
        return was_first and track.first_at is not None

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
        return Summary(
            finish_reason="stop" if stopped else chunk.finish_reason,
            stop_reason=text.stop_hit if stopped else chunk.stop_reason,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=track.output_tokens,
            cached_prompt_tokens=chunk.num_cached_tokens,
            path=first.chosen.path,
            prefill_worker=track.replanned_to or first.chosen.prefill_worker,
            decode_worker=chosen.decode_worker,
            ttft_s=track.ttft_s or 0.0,
            decision=first,
            kv_fallback=track.kv_fallback,
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

    def _place(
        self, wid: str, shape: RequestShape, chosen: PathPrediction
    ) -> tuple[WorkerState, WorkerState]:
        """Enter a placed request in the books: (the worker that prefills it, its decode worker).
        A disaggregated request counts on its decode worker at once (its blocks are reserved
        there first); a colocated one, once its first token is out."""
        d = self.states[chosen.decode_worker]
        prefill_on = self.states.get(chosen.prefill_worker) or d
        hit = prefill_on.cached_tokens(shape.hashes, shape.prompt_len)
        n_prefill = shape.prompt_len - hit
        prefill_on.add_prefill(wid, n_prefill, prefill_pairs(n_prefill, hit))
        if prefill_on is not d:
            d.add_decode(wid, shape.prompt_len, shape.slo_itl_s)
        prefill_on.prefix.insert(shape.hashes)
        d.prefix.insert(shape.hashes)
        return prefill_on, d

    def _trained(self, rid: str, decision: Decision, track: Tracker) -> None:
        """The first token is out: keep the decision with its measured TTFT, and train the
        path's bias (unless a failed handoff made the decode worker prefill after all)."""
        ttft = track.ttft_s or 0.0
        disturbed = bool(track.kv_fallback or track.replanned_to or track.resumed)
        self.records.append(DecisionRecord(rid, decision, ttft, disturbed))
        latest = itertools.islice(
            (r for r in reversed(self.records) if r.measured_ttft_s and not r.disturbed),
            MARGIN_WINDOW,
        )
        self.ttft_margin = ttft_margin(
            (r.decision.chosen.ttft_s, r.measured_ttft_s or 0.0) for r in latest
        )
        self.sink.first_token(
            track.path, ttft, track.queue_s, track.prefill_s, decision.chosen.ttft_s
        )
        chosen = decision.chosen
        if chosen.path is RoutePath.COLOCATED or track.handed_off:
            self.planner.bias[chosen.path].observe(chosen.raw_ttft_s, ttft)

    # -- reading -----------------------------------------------------------------------------
    def prediction_error(self, path: RoutePath | None = None, last: int = 200) -> float | None:
        """Median |predicted - measured| / measured TTFT over the latest requests (of `path`)."""
        errs = [
            abs(r.decision.chosen.ttft_s - r.measured_ttft_s) / r.measured_ttft_s
            for r in list(self.records)[-last:]
            if r.measured_ttft_s and (path is None or r.decision.chosen.path is path)
        ]
        return statistics.median(errs) if errs else None


def ttft_margin(pairs: Iterable[tuple[float, float]]) -> float:
    """From (predicted, measured) TTFTs: the MARGIN_QUANTILE of measured / predicted, so that
    admission judges a prediction as late as most first tokens have lately come. Never below 1
    (predictions that run early do not loosen admission), never above MARGIN_MAX (a few strays
    cannot shut it), and 1 until MARGIN_MIN_SAMPLES first tokens have been seen. On the bare
    prediction, a request predicted just under its SLO is admitted and misses it whenever its
    first token comes later than predicted: on a shared machine, often."""
    ratios = [measured / predicted for predicted, measured in pairs if predicted > 0]
    if len(ratios) < MARGIN_MIN_SAMPLES:
        return 1.0
    q = statistics.quantiles(ratios, n=100, method="inclusive")[round(MARGIN_QUANTILE * 100) - 1]
    return min(max(q, 1.0), MARGIN_MAX)


async def _close(stream: AsyncIterator[TokenChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _late(track: Tracker, shape: RequestShape) -> bool:
    """The first token came after the TTFT SLO: the request can no longer attain."""
    return track.ttft_s is not None and track.ttft_s > shape.slo_ttft_s
