"""A placement's prediction (PathPrediction; router/placement_costs.py computes one for each
candidate) and what it comes to: the SLO misses to expect, the new request's own (its TTFT or its
ITL past the SLO, by how far such predictions err) and those it causes among the running
requests; and how candidates compare: those tied on the fewest expected misses with about as
quick a first token (eligible), and of these the best tie-break (choose). The policies
(router/policy.py) choose among these."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.spread import MISS_WIDTH, miss_chance
from router.vocab import RoutePath

# A pair whose recent handoffs fell back more often than this is not chosen while another
# choice remains.
MAX_FAILURE_RATE = 0.5
# Candidates whose expected SLO misses are within this of the fewest tie (see eligible).
MISS_TOLERANCE = 0.1
# Of the candidates tied on expected misses, those whose first token comes at most this share
# of its SLO after the quickest's (and no later than twice the quickest's) count as equally
# quick: the prefill beside the fewest running decodes among them wins (see choose).
TTFT_TOLERANCE = 0.25


@dataclass(frozen=True, slots=True)
class RequestShape:
    prompt_len: int
    hashes: tuple[bytes, ...]  # the prompt's full-block prefix hashes
    max_tokens: int
    slo_ttft_s: float
    slo_itl_s: float
    # The most its prompt may wait for the decodes running where it is prefilled (Placement
    # prefill_hold_s; None: each worker's own hold; 0: never).
    prefill_hold_s: float | None = None

    @property
    def decodes(self) -> bool:
        """Whether it decodes at all: a request of one token (max_tokens 1: a score, a label,
        an echoed prompt's logprobs) is answered by its prefill, which samples its one token;
        it has no gaps, sets no worker decoding, and may be answered by a prefill worker
        (router/candidates.py answering)."""
        return self.max_tokens > 1


@dataclass(frozen=True, slots=True)
class PathPrediction:
    path: RoutePath
    prefill_worker: str  # "" on the colocated path
    decode_worker: str
    ttft_s: float  # bias included
    raw_ttft_s: float  # the models alone
    itl_s: float  # this request's decode step
    running_itl_s: float  # the step the decode worker's running requests see meanwhile
    running_itl_before_s: float  # ... and would see without this request
    running_itl_slo_s: float  # the tightest ITL SLO among them (inf: none)
    queue_s: float
    prefill_s: float
    transfer_s: float
    uncached_tokens: int
    transfer_bytes: int
    failure_rate: float = 0.0  # of this pair's recent handoffs (disaggregated)
    # D can never reserve blocks for the prompt's KV: more than its reservations may hold (a
    # worker of both kinds keeps part for its own prefills); the handoff would fall back.
    no_room: bool = False
    # Expected misses among the requests already decoding on D, and on P (when P decodes too), or
    # to decode there once their local prefill is done.
    caused_misses: float = 0.0
    # The step P's own running requests see while it prefills for D (0: P decodes nothing).
    p_running_itl_s: float = 0.0
    # The decode worker's measured p99 gap over its median (MeasuredGaps.gap_tail): what this
    # request's ITL p99 will be, over the typical step `itl_s`.
    itl_tail: float = 1.0
    # The decode worker's measured median gap (MeasuredGaps.typical_gap): a floor under `itl_s`
    # where other work fills its steps.
    itl_floor_s: float = 0.0
    # The step this request will see beside the prefills its decode worker runs, when they come
    # often enough to set its p99 gap (beside_floor; 0: they do not).
    itl_beside_s: float = 0.0
    # How much longer the decode worker's gaps are than its steps (MeasuredGaps.gap_factor):
    # `itl_s` and `itl_beside_s` are steps, an ITL SLO holds gaps.
    itl_gap_factor: float = 1.0
    # How many times their predicted p99 gap the decode worker's requests of this kind (prefilled
    # there, or their KV from a peer) have seen lately (MeasuredGaps.itl_bias_factor).
    itl_bias: float = 1.0
    # The requests decoding (or to decode) on the worker that prefills this prompt whose ITL SLO
    # its steps put at risk: what the tie-break keeps low.
    prefill_beside: int = 0
    # Where the decode worker stands among those the tie-break prefers for decoding: a dedicated
    # decode worker (False, False, 0) first, one where a prefill runs (this one's, colocated, or
    # others queued there) after it, then workers of both kinds where no prefill runs, then
    # those where one does; of these, the one with the most decodes running or to come first
    # (-decodes): decodes gather, the others stay free to prefill. A request of one token leans
    # to a prefill worker, then to where the fewest decodes run or come (placement_costs.py
    # _without_gaps).
    decode_lean: tuple[bool, bool, int] = (False, False, 0)
    # Admission would refuse this placement (`shed`): to the goodput, the new request is lost.
    refused: bool = False
    # A prefill worker answers the request whole (one token: candidates.answering); its TTFT is
    # predicted, and its first token trains, a correction of its own (Candidates.answer_bias).
    answered: bool = False
    # How far TTFT and ITL p99 predictions have come from what was measured (router/spread.py):
    # the widths of this request's miss chances.
    ttft_width: float = MISS_WIDTH
    itl_width: float = MISS_WIDTH

    @property
    def failing(self) -> bool:
        return self.no_room or self.failure_rate > MAX_FAILURE_RATE

    def with_failure_risk(
        self, rate: float, wasted_s: float, local_ttft_s: float
    ) -> PathPrediction:
        """The expected TTFT when a handoff falls back with probability `rate`: the time it
        wastes, then a prefill on the decode worker (`local_ttft_s`)."""
        ttft = (1 - rate) * self.ttft_s + rate * (wasted_s + local_ttft_s)
        return replace(self, ttft_s=ttft, failure_rate=rate)

    @property
    def overshoot_s(self) -> float:
        """How far this request takes a running request's ITL past its SLO (past what work
        already there does anyway, which is not this request's doing)."""
        floor = max(self.running_itl_slo_s, self.running_itl_before_s)
        return max(0.0, self.running_itl_s - floor)

    @property
    def itl_p99_s(self) -> float:
        """This request's predicted p99 gap: `raw_itl_p99_s` times the bias of such predictions
        on its decode worker (`itl_bias`), and no shorter than its own step as a gap nor the
        worker's median gap: a p99 is no quicker than the typical gap. A bias below 1 learned
        from placements predicted high (beside prefills that have since gone) took colocated
        predictions to 31-46 ms on a worker whose gaps were 60-80 ms (long-prompt, 2-core CPU
        host), and those placements were taken over quicker handoffs: they missed at 206-247 ms
        and 16-25 s first tokens."""
        return max(self.raw_itl_p99_s * self.itl_bias, self.itl_gap_s, self.itl_floor_s)

    @property
    def raw_itl_p99_s(self) -> float:
        """Its step as a gap (times the worker's gaps over its steps; no shorter than the gaps
        requests see there now) times the worker's tail, and no shorter than the step beside the
        prefills its decode worker runs, when these come often (a worker that prefills for its
        peers with few requests of its own decoding has no measured tail to show them), as a gap
        too."""
        beside = self.itl_beside_s * self.itl_gap_factor
        return max(max(self.itl_gap_s, self.itl_floor_s) * self.itl_tail, beside)

    @property
    def itl_checkable(self) -> bool:
        """Whether what its request's p99 gap then comes to may teach the bias and spread of such
        predictions: made with the decode worker's gaps measured (its median gap as the floor,
        their tail). One made before (the first requests a worker decodes, or after a quiet
        spell) lacks what the later ones hold, and its error is not theirs: on bursty at c9aa841
        (2-core CPU host), the first burst's gaps came 1.3-3.3x their prediction without floor or
        tail, and the next burst's, with both and that bias (x1.2-2.1), at 0.3-0.9x: every
        placement read as an ITL miss, and the choice among them as a tie."""
        return self.itl_floor_s > 0

    @property
    def itl_gap_s(self) -> float:
        """This request's predicted step as a gap: what its ITL SLO holds."""
        return self.itl_s * self.itl_gap_factor

    def shed(self, slo_ttft_s: float, margin: float) -> bool:
        """Whether admission refuses this placement (router/admission.py): its predicted TTFT,
        times `margin` (how late first tokens predicted near their SLO have come lately), misses
        the TTFT SLO, and it would queue (a request that misses on idle workers is served
        anyway)."""
        return self.ttft_s * margin > slo_ttft_s and self.queue_s > 0

    def new_miss(self, req: RequestShape) -> float:
        """The chance that this request itself misses its SLO: its TTFT or its ITL; certain
        where admission would refuse it (`refused`)."""
        if self.refused:
            return 1.0
        ok = (1 - miss_chance(self.ttft_s, req.slo_ttft_s, self.ttft_width)) * (
            1 - miss_chance(self.itl_p99_s, req.slo_itl_s, self.itl_width)
        )
        return 1.0 - ok

    def expected_misses(self, req: RequestShape) -> float:
        """SLO misses to expect from this choice: the new request's, and those it causes."""
        return self.new_miss(req) + self.caused_misses

    def ties(self, fewest: float, req: RequestShape) -> bool:
        """Whether its expected SLO misses (the new request's and the running ones' alike: no
        single guard vetoes a choice) are within MISS_TOLERANCE of the `fewest` of any
        candidate: less than a tenth of a request more is no reason to take a slower first
        token. Candidates that tie are told apart by `choose`."""
        return self.expected_misses(req) <= fewest + MISS_TOLERANCE

    def tie_break(self, req: RequestShape) -> tuple[int, tuple[bool, bool, int], float, float]:
        """Among candidates tied on expected misses and about as quick a first token (see `choose`):
        the prefill beside the fewest running decodes whose SLO it puts at risk (`prefill_beside`:
        prefills placed beside decodes come again and again, and their p99 gaps pass the SLO more
        often than the step model predicts), then a dedicated decode worker (handing off to it
        before prefilling there a prompt whose compute outlasts its ITL SLO), then a worker of both
        kinds where no prefill runs, then the one with the most decodes running or to come
        (`decode_lean`: decodes gather where decodes run and prefills go where none do, the split a
        disaggregated deployment makes, from the first request on, until the expected misses or the
        first token's delay say otherwise), then the least predicted SLO violation (where every
        choice is predicted to miss, how far: a miss is a miss to the goodput, and the split is kept
        for the requests to come), then the earliest predicted second token (TTFT + ITL: of two
        equally fast prefills, the less busy decode worker wins)."""
        second = self.ttft_s + self.itl_gap_s
        return self.prefill_beside, self.decode_lean, self.violation(req), second

    def violation(self, req: RequestShape) -> float:
        ttft, itl = self.ttft_s / req.slo_ttft_s, self.itl_gap_s / req.slo_itl_s
        return max(0.0, ttft - 1) + max(0.0, itl - 1)


def ttft_tolerance(quickest_s: float, req: RequestShape) -> float:
    """How much later than `quickest_s` a first token counts as about as quick: a quarter of the
    TTFT SLO (TTFT_TOLERANCE), and no more than `quickest_s` itself (under a loose SLO, or none,
    a first token seconds sooner still counts)."""
    slo = req.slo_ttft_s
    share = TTFT_TOLERANCE * slo if math.isfinite(slo) and slo > 0 else math.inf
    return max(0.0, min(share, quickest_s))


def eligible(cands: Sequence[PathPrediction], req: RequestShape) -> list[PathPrediction]:
    """The candidates that tie on the fewest expected misses (`ties`; those admission takes, if
    any) whose first token comes within `ttft_tolerance` of the quickest of them: those the
    tie-break chooses among. A tolerance, not a rounding: expected misses of 0.99 and 1.01 tie
    (in tenths rounded down, the former won whatever its first token's delay)."""
    fewest = min(c.expected_misses(req) for c in cands)
    tied = [c for c in cands if c.ties(fewest, req)]
    tied = [c for c in tied if not c.refused] or tied  # one admission takes, if any
    quickest = min(c.ttft_s for c in tied)
    limit = quickest + ttft_tolerance(quickest, req)
    return [c for c in tied if c.ttft_s <= limit]


def choose(cands: Sequence[PathPrediction], req: RequestShape) -> PathPrediction:
    """The candidate to take: the best `tie_break` among the `eligible`."""
    return min(eligible(cands, req), key=lambda c: c.tie_break(req))
