"""Where a request runs: the policies that choose among the predictions for every (path, prefill
worker, decode worker) (router/candidates.py makes them).

  - auto: the cost model, over every (P, D) among the workers able to take each role (P = D:
    colocated). Disaggregated candidates whose pair keeps falling back to a local prefill (failure
    rate over MAX_FAILURE_RATE, router/handoff_model.py HandoffHealth) are dropped while any other
    remains, and every disaggregated prediction carries its pair's failure risk. Of the rest, the
    one with the fewest expected SLO misses wins: the new request's own chance of missing (its TTFT
    or ITL), plus the misses it would cause among the requests already decoding on D and on P, or to
    decode there once their local prefill is done (their steps with it, against without it; a
    request whose first token came after its TTFT SLO cannot attain and counts for nothing). A
    placement admission would refuse (router/admission.py: its TTFT, times how late first tokens
    have come lately, past the SLO while it queues) is a certain miss of the new request. No single
    guard vetoes a choice: pushing one running request past its ITL SLO can be worth it when every
    other choice makes the new request miss, and is not when it would push many. Of those tied on
    expected misses (within a tenth of a request of the fewest), the ones whose first token comes
    within a quarter of its TTFT SLO of the quickest (and within twice the quickest) count as
    equally quick, and among them the prefill beside the fewest running decodes whose ITL SLO it
    puts at risk wins, then a dedicated decode worker, then the worker of both kinds with the most
    decodes running or to come (decodes gather, prefills go where none run: a disaggregated split,
    until the expected misses say otherwise), then the least predicted SLO violation (where every
    choice misses), then the earliest predicted second token (TTFT + ITL): see router/predictions.py
    choose. The decision's reason code says which of these decided.
  - colocated / disaggregated: always that path, workers from the balancer (router/balancer.py).
  - threshold (Dynamo's rule): disaggregated iff uncached prompt tokens > T and the prefill
    worker's queue holds fewer than Q requests.
A request whose whole answer is its first token (max_tokens 1) may run colocated on a worker
that only prefills as well (router/candidates.py answering): under auto where the cost model
says so (auto hands it off only where admission would refuse every placement answering it
where it is prefilled: a handoff adds a transfer to the same prefill), under colocated (or a
path asked for) where the balancer finds the least load.
Every decision carries the best prediction for each path (the chosen one for its own path) and
a reason in words.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.balancer import pick_decode, pick_prefill, with_peer
from router.candidates import Candidates, answering, reservable
from router.capacity import DecodeOverload
from router.handoff_model import HandoffHealth, TransferTimeModel
from router.pool_state import WorkerState
from router.predictions import PathPrediction, RequestShape, choose, eligible
from router.vocab import RoutePath


class Policy(enum.Enum):
    AUTO = "auto"
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    THRESHOLD = "threshold"


_FIXED_WHY = {
    "override": "requested by the client",
    "prompt_logprobs": "prompt logprobs are computed where the prompt is prefilled",
}


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    policy: Policy = Policy.AUTO
    threshold_tokens: int = 256  # threshold policy: T
    threshold_queue: int = 4  # threshold policy: Q
    affinity_margin: float = 0.1  # load-score gap within which prefix affinity decides


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: PathPrediction
    best: tuple[PathPrediction, ...]  # the best candidate of each path; the chosen for its own
    reason: str  # in words, for logs and the client
    reason_code: str  # a short label, for metrics
    # Taking the request sets a rate of requests the decodes cannot hold (admission refuses it;
    # router/capacity.py DecodeDemand.overload); None: they can, or the rate is not known.
    overload: DecodeOverload | None = None


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def _misses(c: PathPrediction, req: RequestShape) -> str:
    """A candidate's expected SLO misses, in words."""
    where = f" on {c.prefill_worker}->{c.decode_worker}" if c.prefill_worker else ""
    own = "admission would refuse it" if c.refused else f"its own {c.new_miss(req):.2f}"
    return (
        f"expected SLO misses {c.expected_misses(req):.2f}{where} ({own}, "
        f"running requests' {c.caused_misses:.2f})"
    )


def _tie_broken(
    req: RequestShape, chosen: PathPrediction, usable: list[PathPrediction], parts: list[str]
) -> str:
    """The reason code of a choice among candidates tied on expected misses, and its reason in words
    when the tie-break, not the quickest second token, decided."""
    quickest = min(eligible(usable, req), key=lambda c: c.ttft_s + c.itl_s)
    if quickest is chosen or quickest.tie_break(req) == chosen.tie_break(req):
        return "cost_ttft"
    where = f"{quickest.prefill_worker or quickest.decode_worker}->{quickest.decode_worker}"
    if chosen.prefill_beside < quickest.prefill_beside:
        parts.append(
            f"prefilled beside {chosen.prefill_beside} running decodes, not "
            f"{quickest.prefill_beside} ({where}, TTFT {_ms(quickest.ttft_s)})"
        )
        return "cost_prefill_beside"
    both, prefills, lean = chosen.decode_lean
    if not req.decodes:  # its prefill's lean (placement_costs.py _lean)
        on = "a prefill worker" if chosen.answered else f"{lean} decodes running or to come"
        parts.append(
            f"answered on {chosen.decode_worker} ({on}): one token, nothing to decode; not "
            f"{quickest.decode_worker} ({where}, TTFT {_ms(quickest.ttft_s)})"
        )
        return "cost_one_token"
    # The chosen decode worker runs no prefill beside its decodes; the quickest's would.
    kept_apart = not prefills and quickest.decode_lean[1]
    if kept_apart and not both:
        parts.append(
            f"prefilled on {chosen.prefill_worker or chosen.decode_worker}, not beside the "
            f"decodes to come on {quickest.decode_worker} ({where}, TTFT {_ms(quickest.ttft_s)})"
        )
        return "cost_split"
    there = f"{-lean} decodes running or to come there" if both else "a dedicated decode worker"
    if kept_apart:
        there += ", no prefill"
    parts.append(
        f"decodes gather on {chosen.decode_worker} ({there}), not {quickest.decode_worker} "
        f"({where}, TTFT {_ms(quickest.ttft_s)})"
    )
    return "cost_gather_decodes"


class Planner(Candidates):
    def __init__(
        self,
        config: PolicyConfig,
        transfer: TransferTimeModel,
        health: HandoffHealth | None = None,
    ) -> None:
        super().__init__(transfer, health)
        self.config = config
        # Whether decisions say when taking the request sets a rate the decodes cannot hold
        # (Decision.overload; RouterConfig.decode_rate_admission, set by the core).
        self.rate_admission = True

    def decide(
        self,
        req: RequestShape,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        override: RoutePath = RoutePath.AUTO,
        admitting: bool = True,
        why: str = "override",
    ) -> Decision:
        """The placement of a request. `override` (not AUTO) names its path, `why` says who
        asked: "override" the client, "prompt_logprobs" a request that asks for them (computed
        where the prompt is, on the colocated path)."""
        cands = self.candidates(req, prefill, decode, admitting)
        best = tuple(
            choose(group, req)
            for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED)
            if (group := [c for c in cands if c.path is path])
        )
        policy = self.config.policy
        if override is not RoutePath.AUTO:
            decision = self._fixed(req, override, prefill, decode, cands, best, why)
        elif policy is Policy.AUTO:
            decision = self._auto(req, cands, best)
        elif policy is Policy.THRESHOLD:
            decision = self._threshold(req, prefill, decode, cands, best)
        else:
            path = RoutePath.COLOCATED if policy is Policy.COLOCATED else RoutePath.DISAGGREGATED
            decision = self._fixed(req, path, prefill, decode, cands, best, "policy")
        # The chosen placement stands for its path among the best (what the client is told was
        # predicted for the placement it got).
        chosen = decision.chosen
        best = tuple(chosen if b.path is chosen.path else b for b in decision.best)
        overload = None
        if admitting and self.rate_admission and req.decodes:
            # Under auto the decodes keep off one worker of both kinds where no dedicated
            # prefill worker is left (DecodeDemand.decoders); any other policy decodes on all.
            spread = policy is Policy.AUTO and override is RoutePath.AUTO
            decoders = self.demand.decoders(prefill, decode) if spread else list(decode)
            overload = self.demand.overload(decoders, req.slo_itl_s)
        return replace(decision, best=best, overload=overload)

    def _find(self, cands: list[PathPrediction], path: RoutePath, p: str, d: str) -> PathPrediction:
        return next(
            c for c in cands if c.path is path and c.prefill_worker == p and c.decode_worker == d
        )

    def _fixed(
        self,
        req: RequestShape,
        path: RoutePath,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        cands: list[PathPrediction],
        best: tuple[PathPrediction, ...],
        why: str,
    ) -> Decision:
        if path is RoutePath.DISAGGREGATED:
            decode = with_peer(prefill, decode) or decode  # not the one worker that prefills
            decode = [d for d in decode if reservable(req, d)] or decode  # one that can hold it
        else:
            decode = answering(req, prefill, decode)
        d = pick_decode(req, decode, self.config.affinity_margin).worker_id
        prefill = [p for p in prefill if p.worker_id != d]
        if path is RoutePath.DISAGGREGATED and not prefill:
            chosen = self._find(cands, RoutePath.COLOCATED, "", d)
            return Decision(
                chosen,
                best,
                "disaggregated asked, but no worker other than its decode worker can prefill",
                "no_prefill_workers",
            )
        p = ""
        if path is RoutePath.DISAGGREGATED:
            p = pick_prefill(prefill, d, self.health).worker_id
        chosen = self._find(cands, path, p, d)
        label = _FIXED_WHY.get(why, f"--policy {path.value}")
        return Decision(chosen, best, f"{path.value}: {label}", why)

    def _auto(
        self, req: RequestShape, cands: list[PathPrediction], best: tuple[PathPrediction, ...]
    ) -> Decision:
        usable = [c for c in cands if not c.failing] or cands
        # Nothing to decode: a handoff adds a transfer to the prefill (taken only where
        # admission would refuse every placement answering it where it is prefilled).
        if not req.decodes:
            local = [c for c in usable if c.path is RoutePath.COLOCATED]
            if any(not c.refused for c in local):
                usable = local
        chosen = choose(usable, req)
        # The other paths' best that could be taken, against which the reason weighs the
        # choice; a path with none is said as why (the best of those that cannot).
        others = [
            choose([c for c in usable if c.path is path] or group, req)
            for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED)
            if path is not chosen.path and (group := [c for c in cands if c.path is path])
        ]
        itl = (
            f"ITL p99 {_ms(chosen.itl_p99_s)} (bias x{chosen.itl_bias:.2f} included; such "
            f"predictions err by x{math.exp(chosen.ttft_width):.2f} and "
            f"x{math.exp(chosen.itl_width):.2f} lately)"
            if req.decodes
            else f"one token, no ITL (such TTFT predictions err by "
            f"x{math.exp(chosen.ttft_width):.2f} lately)"
        )
        parts = [
            f"{chosen.path.value}: {_misses(chosen, req)}, predicted TTFT {_ms(chosen.ttft_s)}, "
            + itl
        ]
        if not req.decodes and chosen.path is RoutePath.DISAGGREGATED:
            parts.append("handed off: admission would refuse every placement answering it")
        code = "cost_ttft"
        fewest = min(c.expected_misses(req) for c in usable)
        for o in others:
            if o not in usable and not req.decodes:
                parts.append(
                    f"no handoff: one token, nothing to decode (it would add a transfer to the "
                    f"prefill; the best, {o.prefill_worker}->{o.decode_worker}: TTFT "
                    f"{_ms(o.ttft_s)})"
                )
                continue
            if o.no_room and o not in usable:
                d_id = o.decode_worker
                parts.append(
                    f"{o.path.value}: {d_id} cannot reserve the prompt's KV (its reservations "
                    "may hold part of its blocks and slots: a worker that also prefills keeps the "
                    "rest for its own)"
                )
                code = "handoff_no_room"
                continue
            if o.failing and o not in usable:
                parts.append(
                    f"{o.path.value} handoffs {o.prefill_worker}->{o.decode_worker} keep "
                    f"falling back (failure rate {o.failure_rate:.2f})"
                )
                code = "handoff_failing"
                continue
            parts.append(
                f"vs {o.path.value} {_misses(o, req)}, TTFT {_ms(o.ttft_s)}, ITL p99 "
                f"{_ms(o.itl_p99_s)} (bias x{o.itl_bias:.2f} included)"
            )
            its = (c for c in usable if c.path is o.path)
            if not any(c.ties(fewest, req) for c in its) and code == "cost_ttft":
                code = "cost_misses"  # fewer misses decided, not the TTFT
        if self.decoders_needed > 1:
            parts.append(
                f"decodes need {self.decoders_needed} workers at {self.demand.rate():.2f} req/s"
            )
        shed = sum(c.refused for c in usable)
        if shed and not chosen.refused:
            parts.append(
                f"{shed} of {len(usable)} placements admission would refuse (predicted TTFT x "
                f"{self.ttft_margin:.2f}, how late first tokens predicted near their SLO have come "
                "lately, past the SLO)"
            )
        if code == "cost_ttft":
            code = _tie_broken(req, chosen, usable, parts)
        if code == "cost_ttft" and chosen.violation(req) > 0:
            code = "cost_slo_miss"  # nothing meets the SLO: least violation
        return Decision(chosen, best, "; ".join(parts), code)

    def _threshold(
        self,
        req: RequestShape,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        cands: list[PathPrediction],
        best: tuple[PathPrediction, ...],
    ) -> Decision:
        t, q = self.config.threshold_tokens, self.config.threshold_queue
        margin = self.config.affinity_margin
        d = pick_decode(req, decode, margin)
        uncached = req.prompt_len - d.cached_tokens(req.hashes, req.prompt_len)
        # A handoff decodes on d, or where d is the one worker that can prefill or could never
        # reserve the prompt's KV, on another; the request stays on d unless one is taken.
        paired = [w for w in with_peer(prefill, decode) if reservable(req, w)]
        to = d if d.worker_id in {w.worker_id for w in paired} else None
        if uncached > t and to is None and paired:
            to = pick_decode(req, paired, margin)
        if to is not None:
            p = pick_prefill([w for w in prefill if w.worker_id != to.worker_id], to.worker_id,
                             self.health)  # fmt: skip
            left = req.prompt_len - to.cached_tokens(req.hashes, req.prompt_len)
            if left > t and p.queued_prefills < q:
                chosen = self._find(cands, RoutePath.DISAGGREGATED, p.worker_id, to.worker_id)
                why = f"disaggregated: {left} uncached tokens > {t}, prefill queue < {q}"
                return Decision(chosen, best, why, "threshold_remote")
            if left <= t < uncached:  # the worker it would decode on holds most of its prompt
                chosen = self._find(cands, RoutePath.COLOCATED, "", to.worker_id)
                why = f"colocated: {left} uncached tokens on {to.worker_id} <= {t}"
                return Decision(chosen, best, why, "threshold_local")
        chosen = self._find(cands, RoutePath.COLOCATED, "", d.worker_id)
        if uncached <= t:
            why = f"colocated: {uncached} uncached tokens <= {t}"
        elif to is None and with_peer(prefill, decode):
            why = f"colocated: no decode worker can reserve the KV of {req.prompt_len} tokens"
        elif to is None:
            why = "colocated: no worker other than its decode worker can prefill"
        else:
            why = f"colocated: the prefill queue holds >= {q} requests"
        return Decision(chosen, best, why, "threshold_local")
