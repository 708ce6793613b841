"""How far one kind of prediction comes from what is then measured, as the width of the miss
chance built on it (miss_chance); and which way it errs, as the factor that corrects it
(PredictionBias).

A prediction that says a request's p99 gap will be 250 ms against a 195 ms SLO is a certain
miss only if the prediction is good to a few percent. On a 2-core CPU host the ITL p99 and TTFT
predictions came within a factor of 1.3-2.0 of what was measured (one standard deviation of
ln(measured / predicted): 0.3-0.7 over the mixed, chat and bursty traces), so a miss chance as
sharp as the models' own claim read every request past its SLO as lost: a prefill that took the
running requests from 1.3x to 2.5x of their SLO was seen to cost them nothing."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

# The narrowest miss chance: 0.09 / 0.88 at 10% under / over the SLO (what the step-time model
# claims for a step it has seen); the default width where no spread is known.
MISS_WIDTH = 0.08
# The standard deviation of ln(measured / predicted) before any prediction was checked: a p99 gap
# or a first token predicted by models not yet held against this deployment, about a quarter off
# (on a 2-core CPU host they came 0.2-0.45 off once measured). It weighs as PRIOR_WEIGHT
# predictions: the first few checked move it most of the way. A width as sharp as the models'
# own claim read every request predicted past its SLO as lost from the first request on, while
# the first requests of a burst set every later one's tail.
PRIOR_WIDTH = 0.25
PRIOR_WEIGHT = 4
# Its ceiling: a prediction off by a factor of e, one time in three, still says something.
MAX_WIDTH = 1.0
# A prediction counts where it, or what was then measured, came to this share of its SLO (of a
# 100 ms first token predicted against a 10 s SLO, a 3x error decides nothing).
NEAR_SLO = 0.5
# One standard deviation of a normal error covers this share of its absolute values.
ONE_SIGMA_SHARE = 68.0


class PredictionSpread:
    """The standard deviation of ln(measured / predicted), read as the 68th percentile of its
    absolute values (a bias counts as error too), over the latest `window` predictions that came
    near their SLO (either value at least `near` of it: of a 100 ms first token predicted
    against a 10 s SLO, a 3x error decides nothing), pooled with `prior` as `prior_weight`
    predictions (variances weighed by count), within [MISS_WIDTH, MAX_WIDTH]."""

    def __init__(
        self,
        prior: float = PRIOR_WIDTH,
        prior_weight: int = PRIOR_WEIGHT,
        window: int = 64,
        near: float = NEAR_SLO,
    ) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.near = near
        self._errors: deque[float] = deque(maxlen=window)
        self._width = prior

    def observe(self, predicted_s: float, measured_s: float, slo_s: float) -> None:
        if predicted_s <= 0 or measured_s <= 0 or not math.isfinite(slo_s):
            return
        if max(predicted_s, measured_s) < self.near * slo_s:
            return
        self._errors.append(abs(math.log(measured_s / predicted_s)))
        n, k = len(self._errors), self.prior_weight
        sigma = float(np.percentile(self._errors, ONE_SIGMA_SHARE))
        pooled = math.sqrt((k * self.prior**2 + n * sigma**2) / (k + n))
        self._width = min(MAX_WIDTH, max(MISS_WIDTH, pooled))

    @property
    def width(self) -> float:
        return self._width

    @property
    def samples(self) -> int:
        return len(self._errors)


def miss_chance(predicted_s: float, slo_s: float, width: float = MISS_WIDTH) -> float:
    """The chance that what is predicted to take `predicted_s` ends past `slo_s`, when
    ln(measured / predicted) is normal with standard deviation `width` (how far such
    predictions come from what is measured: PredictionSpread): 0.5 at the SLO."""
    if not math.isfinite(slo_s) or slo_s <= 0 or predicted_s <= 0:
        return 0.0
    return 0.5 * math.erfc(-math.log(predicted_s / slo_s) / (width * math.sqrt(2.0)))


# A kind of prediction's bias is trusted from this many checked predictions on, and forgets
# those older than BIAS_MAX_AGE_S (a kind of placement not taken lately says nothing of now).
BIAS_MIN_SAMPLES = 5
BIAS_MAX_AGE_S = 300.0
# Its bounds: past them the model, not its correction, is wrong.
MAX_BIAS = 3.0


class PredictionBias:
    """How many times its prediction one kind of measured value has come lately: exp(median of
    ln(measured / predicted)) over the latest `window` checked predictions of the last
    `max_age_s`, within [1 / MAX_BIAS, MAX_BIAS]; `default` (1) with fewer than `min_samples`.

    The p99 gap of a request that prefilled on its decode worker came 1.6-2.0x its prediction
    on workers of both kinds (chat and bursty traces on a 2-core CPU host: predicted 95-97 ms,
    measured 151-189 ms), while the requests whose KV came from a peer, most of those that ended
    there, set the worker's tail and the spread of its predictions: colocated placements were
    predicted to attain, then missed. A spread is the width of an error, a bias its direction: a
    prediction 1.7x short every time is no chance of attaining."""

    def __init__(
        self,
        window: int = 32,
        min_samples: int = BIAS_MIN_SAMPLES,
        max_age_s: float = BIAS_MAX_AGE_S,
    ) -> None:
        self.min_samples, self.max_age_s = min_samples, max_age_s
        self._errors: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, predicted_s: float, measured_s: float, now: float | None = None) -> None:
        if predicted_s > 0 and measured_s > 0:
            t = time.monotonic() if now is None else now
            self._errors.append((t, math.log(measured_s / predicted_s)))

    def factor(self, now: float | None = None, default: float = 1.0) -> float:
        """The bias; `default` with too few recent checks."""
        return self._of(self.recent(now), default)

    def pooled(self, others: Iterable[PredictionBias], now: float | None = None) -> float:
        """The bias over its recent checks and those of `others` together (of the same
        measured value: each kind of placement's on one worker); 1 with too few."""
        return self._of([e for b in (self, *others) for e in b.recent(now)], 1.0)

    def recent(self, now: float | None = None) -> list[float]:
        """ln(measured / predicted) of its checks of the last `max_age_s`."""
        t = time.monotonic() if now is None else now
        return [e for at, e in self._errors if at >= t - self.max_age_s]

    def _of(self, errors: list[float], default: float) -> float:
        if len(errors) < self.min_samples:
            return default
        return min(MAX_BIAS, max(1.0 / MAX_BIAS, math.exp(float(np.median(errors)))))

    @property
    def samples(self) -> int:
        return len(self._errors)
