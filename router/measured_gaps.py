"""What a worker's requests measured at the router, and what the router learns from it: their
inter-token gaps, each request's p99 gap over its median (the tail), how far and how biased the
p99 gaps predicted at placement came, and the worker's decode steps against those gaps.

update_tail() folds them into the figures every candidate of every decision reads (gap_tail,
typical_gap, itl_bias_factor, gap_factor), once per load poll. One per worker
(WorkerState.measured, router/pool_state.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from router.spread import PredictionBias, PredictionSpread
from router.vocab import PLACEMENT_KINDS
from worker_protocol.messages import StepStat

# gap_factor: measured once this many gaps and decode steps fall in one window; within [1, this].
MIN_GAP_FACTOR_SAMPLES = 20
MAX_GAP_FACTOR = 4.0


class MeasuredGaps:
    def __init__(self) -> None:
        # (time.monotonic(), gap) of the latest inter-token gaps its requests saw at the router.
        self._gaps: deque[tuple[float, float]] = deque(maxlen=4096)
        # (time.monotonic(), p99 gap / median gap) of the latest requests that ended here.
        self._request_tails: deque[tuple[float, float]] = deque(maxlen=256)
        # How far the p99 gaps predicted for its requests came from those measured: the width of
        # their ITL miss chances (router/predictions.py).
        self.itl_spread = PredictionSpread()
        # How many times their predictions the p99 gaps of its requests have come, by whether
        # they prefilled here (colocated) or their KV came from a peer (router/spread.py); and
        # the factors, as of the last update_tail().
        self.itl_bias = {local: PredictionBias() for _, local in PLACEMENT_KINDS}
        self._itl_bias_factor = dict.fromkeys(self.itl_bias, 1.0)
        self._tail = 1.0  # gap_tail(), as of the last update_tail()
        self._typical_gap = 0.0  # typical_gap(), likewise
        # (time.monotonic(), seconds, decodes) of the latest steps it ran with decodes in them.
        self._decode_steps: deque[tuple[float, float, int]] = deque(maxlen=4096)
        self._gap_factor: float | None = None  # gap_factor() as measured here (None: not yet)
        # What the deployment's other workers measured, for a worker that has not yet (set by
        # router/membership.py; 1: none has).
        self.peers_gap_factor = 1.0

    def observe_steps(self, steps: Sequence[StepStat], now: float) -> None:
        """The steps of a polled load: those with decodes in them count for gap_factor."""
        self._decode_steps.extend((now, s.seconds, s.decode_seqs) for s in steps if s.decode_seqs)

    def observe_gaps(self, gaps: Sequence[float], now: float | None = None) -> None:
        """Inter-token gaps a request decoding here just saw (measured at the router)."""
        t = time.monotonic() if now is None else now
        self._gaps.extend((t, g) for g in gaps)

    def recent_gaps(self, since: float) -> list[float]:
        return [g for t, g in self._gaps if t >= since]

    def observe_request(
        self,
        gaps: Sequence[float],
        predicted_p99_s: float = 0.0,
        slo_s: float = float("inf"),
        now: float | None = None,
        local: bool | None = None,
        raw_p99_s: float = 0.0,
    ) -> None:
        """The gaps of a request that decoded here, all of them, as it ends (at least 10), and
        the p99 gap predicted at its placement against its ITL SLO (0, inf: none); `local`:
        whether it prefilled here (None: neither kind's bias learns from it), `raw_p99_s` that
        prediction before the bias of its kind (itl_bias_factor)."""
        if len(gaps) >= 10:
            p50, p99 = np.percentile(gaps, [50, 99])
            self.itl_spread.observe(predicted_p99_s, float(p99), slo_s)
            if local is not None:
                self.itl_bias[local].observe(raw_p99_s, float(p99), now)
            if p50 > 0:
                t = time.monotonic() if now is None else now
                self._request_tails.append((t, float(p99 / p50)))

    def gap_tail(self) -> float:
        """How much longer a request's slow gaps are than its typical one (see update_tail): a
        request's ITL SLO holds its p99 gap, while the step-time model predicts the typical
        step."""
        return self._tail

    def itl_bias_factor(self, local: bool) -> float:
        """How many times their predicted p99 gap the requests that prefilled here (`local`) or
        whose KV came from a peer have seen lately; with too few of that kind, all of its
        requests (see update_tail)."""
        return self._itl_bias_factor[local]

    def typical_gap(self) -> float:
        """The median of the recent gaps its requests saw (0 with too few; see update_tail): a
        floor under the predicted step of a request decoding here. The step-time model knows
        the decode batch; what else runs in the worker's steps (prefill chunks, its own or a
        peer's, at up to its step target, one after another while prompts keep coming) shows
        here."""
        return self._typical_gap

    def update_tail(
        self,
        window_s: float = 30.0,
        min_gaps: int = 50,
        requests_window_s: float = 120.0,
        min_requests: int = 8,
    ) -> None:
        """The tail, in [1, 4]: the median over the requests that ended here in the last
        `requests_window_s` of each one's p99 gap over its median gap; until `min_requests`
        have, the p99 of the last `window_s` of all gaps over their median (which overstates
        it: slow moments of the worker fall on a few requests, not on each one's p99); 1 with
        fewer than `min_gaps` gaps. And the median gap of that window (0 with too few), and the
        bias of each kind of p99 gap prediction. Once per load poll: every candidate of every
        decision reads them."""
        now = time.monotonic()
        gaps = self.recent_gaps(now - window_s)
        tail, typical = 1.0, 0.0
        if len(gaps) >= min_gaps:
            p50, p99 = np.percentile(gaps, [50, 99])
            tail = float(p99 / p50) if p50 > 0 else 1.0
            typical = float(p50)
        ratios = [r for t, r in self._request_tails if t >= now - requests_window_s]
        if len(ratios) >= min_requests:
            tail = float(np.median(ratios))
        self._tail, self._typical_gap = min(4.0, max(1.0, tail)), typical
        # A kind with too few checks of its own (a few of its own count among the others')
        # takes the worker's, over all kinds (1 with too few of those): both decode in the
        # same steps. At 1, a kind not taken lately reads as predicted where the other has
        # come late, and the untried placement looks the better one. In run cal at 1.0 req/s
        # (mixed, a7b9eb7), auto colocated 8 requests of 30 on the split's decode worker, each
        # read to miss its own ITL SLO less than handed off to the same worker (0.64-0.79
        # against 0.84-0.90; that the kinds' biases made the difference is inferred, those
        # records do not show them), and 25 of the 30 missed their ITL SLO (4 under the split).
        first, *rest = self.itl_bias.values()
        pooled = first.pooled(rest, now)
        self._itl_bias_factor = {k: b.factor(now, pooled) for k, b in self.itl_bias.items()}
        # A step with n decodes gives n gaps: the steps weigh as many.
        recent = [(s, n) for t, s, n in self._decode_steps if t >= now - window_s]
        if min(len(gaps), len(recent)) >= MIN_GAP_FACTOR_SAMPLES:
            step = float(np.median(np.repeat([s for s, _ in recent], [n for _, n in recent])))
            if step > 0:
                factor = float(np.median(gaps)) / step
                self._gap_factor = min(MAX_GAP_FACTOR, max(1.0, factor))

    def gap_factor(self) -> float:
        """How much longer the gaps its requests see at the router are than the steps it runs
        (the median of each over the last window with enough of both, each step weighed by its
        decodes, one gap each): a step is the model's forward pass, a gap also its way out of
        the engine and to the router. The step-time model predicts steps; an ITL SLO holds gaps.
        It holds once measured (a property of the worker's process and transport, not of its
        load), and until then is what the deployment's other workers measured
        (`peers_gap_factor`)."""
        return self._gap_factor if self._gap_factor is not None else self.peers_gap_factor

    @property
    def own_gap_factor(self) -> float | None:
        return self._gap_factor

    def carry(self, old: MeasuredGaps) -> None:
        """What a replacement keeps of `old`'s (see WorkerState.carry)."""
        self.itl_spread, self.itl_bias = old.itl_spread, old.itl_bias
        self._itl_bias_factor = dict(old._itl_bias_factor)
        self._gap_factor = old.own_gap_factor
