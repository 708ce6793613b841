"""How far one kind of prediction comes from what is then measured, as the width of the miss
chance built on it (miss_chance).

A prediction that says a request's p99 gap will be 250 ms against a 195 ms SLO is a certain
miss only if the prediction is good to a few percent. On a 2-core CPU host the ITL p99 and TTFT
predictions came within a factor of 1.3-2.0 of what was measured (one standard deviation of
ln(measured / predicted): 0.3-0.7 over the mixed, chat and bursty traces), so a miss chance as
sharp as the models' own claim read every request past its SLO as lost: a prefill that took the
running requests from 1.3x to 2.5x of their SLO was seen to cost them nothing."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

# The standard deviation of ln(measured / predicted) before anything was measured, and its floor:
# a miss chance of 0.09 / 0.88 at 10% under / over the SLO.
MISS_WIDTH = 0.08
# Its ceiling: a prediction off by a factor of e, one time in three, still says something.
MAX_WIDTH = 1.0
# One standard deviation of a normal error covers this share of its absolute values.
ONE_SIGMA_SHARE = 68.0


class PredictionSpread:
    """The standard deviation of ln(measured / predicted), read as the 68th percentile of its
    absolute values (a bias counts as error too), over the latest `window` predictions that came
    near their SLO (either value at least `near` of it: of a 100 ms first token predicted
    against a 10 s SLO, a 3x error decides nothing), within [MISS_WIDTH, MAX_WIDTH]; MISS_WIDTH
    until `min_samples` such came."""

    def __init__(self, window: int = 64, min_samples: int = 8, near: float = 0.5) -> None:
        self.min_samples = min_samples
        self.near = near
        self._errors: deque[float] = deque(maxlen=window)
        self._width = MISS_WIDTH

    def observe(self, predicted_s: float, measured_s: float, slo_s: float) -> None:
        if predicted_s <= 0 or measured_s <= 0 or not math.isfinite(slo_s):
            return
        if max(predicted_s, measured_s) < self.near * slo_s:
            return
        self._errors.append(abs(math.log(measured_s / predicted_s)))
        if len(self._errors) >= self.min_samples:
            sigma = float(np.percentile(self._errors, ONE_SIGMA_SHARE))
            self._width = min(MAX_WIDTH, max(MISS_WIDTH, sigma))

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
