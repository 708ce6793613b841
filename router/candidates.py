"""Every placement a request could take, predicted: the colocated path on each decode worker D
(and, for a request whose whole answer is its first token, on each worker that only prefills:
`answering`) and the disaggregated path over each pair (P, D) of distinct workers
(router/placement_costs.py prices each one), with what the router has learnt applied to them:
the path's TTFT bias (the other path's while its own has seen too few first tokens; a prefill
worker's answers have their own, `answer_bias`), how far TTFT predictions have erred, the step
target each decode worker takes once the request is placed there, what the workers' node peers
run now, the misses that setting a worker decoding causes on its node unless the decodes need
it at the current rate (router/capacity.py), a pair's failure risk (router/handoff_model.py
HandoffHealth), whether D can reserve the prompt's KV, and whether admission would refuse the
placement. The Planner (router/policy.py) chooses among them by its policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from engine.kv_cache_manager import cdiv
from engine.kv_handoff import within_share
from router.capacity import DecodeDemand
from router.handoff_model import HandoffHealth, TransferTimeModel
from router.interference import shared_misses
from router.placement_costs import predict_colocated, predict_disaggregated
from router.pool_state import WorkerState, peer_work
from router.predictions import PathPrediction, RequestShape
from router.spread import PredictionSpread
from router.ttft_bias import Bias
from router.vocab import RoutePath
from worker_protocol.messages import WorkerRole


def reservable(req: RequestShape, d: WorkerState) -> bool:
    """Whether `d` could reserve a sequence slot and blocks for the prompt's whole KV, its
    reservations holding no others."""
    i = d.info
    blocks = cdiv(req.prompt_len, i.block_size)
    return within_share(i.reserve_share, i.max_num_seqs, i.num_blocks, 1, blocks)


def answering(
    req: RequestShape, prefill: Sequence[WorkerState], decode: Sequence[WorkerState]
) -> list[WorkerState]:
    """The workers `req` may run on whole (the colocated path): those that decode, and where its
    whole answer is its first token (max_tokens 1: a score, a label, an echoed prompt's
    logprobs), the workers that only prefill as well, listed first (the balancer takes the
    first of those tied): it has nothing to decode, so no KV need move, and the decode workers'
    steps are left to their decodes."""
    if req.decodes:
        return list(decode)
    return [*(w for w in prefill if w.info.role == WorkerRole.PREFILL), *decode]


class Candidates:
    """The predictions of every placement, and what they are made with (the core trains and sets
    these). The Planner (router/policy.py) adds the policies."""

    def __init__(self, transfer: TransferTimeModel, health: HandoffHealth | None = None) -> None:
        self.transfer = transfer
        self.health = health or HandoffHealth()
        self.bias = {RoutePath.COLOCATED: Bias(), RoutePath.DISAGGREGATED: Bias()}
        # A prefill worker's answers (one token) have their own, none until it has seen enough
        # of them: a queue and a prefill there, neither a colocated prompt's chunks beside
        # decodes nor a handoff's transfer and hops (on the suite's tiny model, the handoffs'
        # correction put an idle prefill worker's answer at 3x a decode worker's).
        self.answer_bias = Bias()
        # Admission's factor on predicted TTFT (router/admission.py ttft_margin), set by the core.
        self.ttft_margin = 1.0
        # How far TTFT predictions came from measured first tokens (trained by the core): the
        # width of every candidate's TTFT miss chance.
        self.ttft_spread = PredictionSpread()
        # The step target a worker takes when a request with a given ITL SLO is placed on it
        # (StepTargets.for_request, set by the core where it tunes targets; None: unchanged).
        self.target_for: Callable[[WorkerState, float], float | None] | None = None
        # The rate requests arrive and what they decode: how many workers the decodes need.
        self.demand = DecodeDemand()
        self.decoders_needed = 1  # as of the latest candidates()

    def ttft_bias(self, path: RoutePath) -> Bias:
        """The TTFT correction `path`'s predictions take: its own, or while it has seen too few
        first tokens of its own, the other path's. Both are mostly the error of a prefill
        queue's prediction; with one path corrected and the other not, the one left as the
        bare model predicts it would look the quicker for want of first tokens of its own (on
        long-prompt, flex colocates a few requests a round: too few for a correction of their
        own)."""
        own = self.bias[path]
        if own.trained:
            return own
        other = self.bias[
            RoutePath.DISAGGREGATED if path is RoutePath.COLOCATED else RoutePath.COLOCATED
        ]
        return other if other.trained else own

    def candidates(
        self,
        req: RequestShape,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        admitting: bool = True,
    ) -> list[PathPrediction]:
        """Every placement's prediction; `admitting`: the request has still to pass admission
        (not one resumed after its decode worker died), so placements admission would refuse
        are marked so."""
        workers = list({id(w): w for w in [*prefill, *decode]}.values())
        for w in workers:  # the node's share, as the books stand now (the poll is older)
            w.set_peer_work(peer_work(w, workers))
        # The workers the decodes need at the current rate (those with the most decodes first):
        # setting one of them decoding costs its node peers nothing the share would count, as
        # they would lose more to the batch gathering builds (router/capacity.py).
        needed = {d.worker_id for d in self.demand.needed(prefill, decode, req.slo_itl_s)}
        self.decoders_needed = len(needed)
        whole = answering(req, prefill, decode)
        # A request of one token sets no worker decoding, and tightens no step target.
        shared = {
            d.worker_id: shared_misses(d, workers)
            if req.decodes and d.worker_id not in needed
            else 0.0
            for d in whole
        }
        width = self.ttft_spread.width
        # Each decode worker's step target as it will be once this request is placed there.
        limits = {
            d.worker_id: self.target_for(d, req.slo_itl_s)
            if self.target_for and req.decodes
            else None
            for d in whole
        }
        out: list[PathPrediction] = []
        b = self.ttft_bias(RoutePath.COLOCATED)
        for d in whole:
            own = self.answer_bias if d.info.role == WorkerRole.PREFILL else b
            with d.model.target_at_most(limits[d.worker_id]):
                out.append(predict_colocated(req, d, own, shared[d.worker_id], width))
        local = {c.decode_worker: c.ttft_s for c in out}
        b = self.ttft_bias(RoutePath.DISAGGREGATED)
        for p in prefill:
            for d in decode:
                if p.worker_id == d.worker_id:
                    continue  # one worker doing both for a request: the colocated candidate
                # Its decode on D is one more that prompts there would wait for (none where a
                # decode of unknown length runs there: no wait is priced then).
                more = req.max_tokens if d.model.decode_left or not d.batch else 0
                with (
                    d.model.target_at_most(limits[d.worker_id]),
                    d.model.decodes_left_at_least(more),
                ):
                    c = predict_disaggregated(
                        req, p, d, self.transfer, b, shared[d.worker_id], width
                    )
                if not reservable(req, d):
                    c = replace(c, no_room=True)
                rate = self.health.failure_rate(p.worker_id, d.worker_id)
                if rate > 0:
                    wasted = self.health.wasted_s(p.worker_id, d.worker_id)
                    c = c.with_failure_risk(rate, wasted, local[d.worker_id])
                out.append(c)
        if not admitting:
            return out
        # A placement admission would refuse loses the request and runs nothing (one miss, none
        # caused): auto takes another where that is expected to cost less.
        m = self.ttft_margin
        return [
            replace(c, refused=True, caused_misses=0.0) if c.shed(req.slo_ttft_s, m) else c
            for c in out
        ]
