"""One placement of a request, run for the request core (router/core.py builds RequestCore on
this): its decision logged, its books placed and its decode worker's step target tightened (a
request that decodes), the backend's stream for it (after a resume, the prompt and the tokens so
far), each chunk booked and detokenized, the first one kept with its decision and training the
path's TTFT bias (a prefill worker's answer: the answers' own), the spread of TTFT predictions
and admission's margin, and the last one summarised (why it finished, what cut it short, how
many prompt tokens were cached).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace

from engine.text_stream import TextStream
from router.admission import TtftMargin
from router.books import RequestBooks
from router.core_types import Backend, CoreChunk, DecisionRecord, Summary
from router.handoff import Handoff
from router.handoff_model import HandoffHealth, TransferTimeModel
from router.policy import Decision, Planner
from router.predictions import PathPrediction, RequestShape
from router.refusal_log import Said
from router.request import ParsedRequest
from router.stats import StatsSink
from router.target_calls import TargetCalls
from router.tracker import Tracker
from router.vocab import FinishReason, Placement, RoutePath
from worker_protocol.messages import TokenChunk

log = logging.getLogger("pdserve.router")
_CUT_SHORT = Said(log, logging.WARNING)  # answers the KV cache cut short
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


class PlacementSteps:
    """The steps of one placement: a mixin of RequestCore (router/core.py), never made alone;
    RequestCore's __init__ sets the parts they use, declared here."""

    backend: Backend
    sink: StatsSink
    planner: Planner
    transfer: TransferTimeModel
    health: HandoffHealth
    target_calls: TargetCalls | None
    records: deque[DecisionRecord]
    margin: TtftMargin

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
        if self.target_calls is not None and shape.decodes:
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
                yield CoreChunk(
                    req.request_id, chunk.token_ids, delta, chunk.logprobs, final,
                    chunk.prompt_logprobs,
                )  # fmt: skip
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
                params,
                max_tokens=params.max_tokens - len(emitted),
                drawn=len(emitted),
                prompt_logprobs=None,  # given with its first token (asks_prompt_logprobs)
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
        path's bias (a prefill worker's answer: the answers' own, Candidates.answer_bias) and
        the spread of TTFT predictions (unless a failed handoff made the decode worker prefill
        after all, or it was replanned or resumed: its first token then came from another
        placement than the one predicted)."""
        ttft = track.ttft_s or 0.0
        disturbed = bool(track.kv_fallback or track.replanned_to or track.resumed)
        self.records.append(DecisionRecord(rid, decision, ttft, disturbed))
        if not disturbed:
            self.planner.ttft_margin = self.margin.observe(decision.chosen.ttft_s, ttft, slo_ttft_s)
        self.sink.first_token(track.first_token())
        chosen = decision.chosen
        if not disturbed and (chosen.path is RoutePath.COLOCATED or track.handed_off):
            bias = self.planner.answer_bias if chosen.answered else self.planner.bias[chosen.path]
            bias.observe(chosen.raw_ttft_s, ttft)
            self.planner.ttft_spread.observe(chosen.ttft_s, ttft, slo_ttft_s)
