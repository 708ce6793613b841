"""TTFT predictions' per-path correction (`Bias`: measured = fixed + scale x predicted, fitted
over the path's latest first tokens), which absorbs what the step-time and transfer models do
not see: RPC hops, token delivery, the engine thread's wake-up, queues over- or
under-estimated."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from router.fits import affine_fit


class Bias:
    """What one path's TTFT predictions miss: measured = fixed + scale x predicted, fitted over its
    latest `window` first tokens (weighing relative errors, as the transfer model does, then
    scaled so that the median of measured / corrected is 1 as far as the bounds allow), the
    scale within [MIN_SCALE, MAX_SCALE], the fixed part never negative. An error that grows with
    the prediction (a queue over- or under-estimated) scales, one that does not (RPC hops, token
    delivery) adds; a plain mean of measured - predicted learnt from long prompts drove short
    prompts' predictions below zero. Where the predictions seen are all of one size, the error
    adds (the median of measured - predicted; scales, when that is negative); past the largest
    prediction seen, it no longer scales (a path that saw short prompts only says little of long
    ones). Identity until `min_samples` first tokens were seen."""

    MIN_SCALE, MAX_SCALE = 0.25, 4.0

    def __init__(self, window: int = 64, min_samples: int = 8) -> None:
        self.min_samples = min_samples
        self._obs: deque[tuple[float, float]] = deque(maxlen=window)
        self._fit: tuple[float, float, float] | None = (0.0, 1.0, math.inf)

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s > 0 and measured_s > 0:
            self._obs.append((predicted_s, measured_s))
            self._fit = None

    @property
    def trained(self) -> bool:
        """Whether it has seen enough first tokens to correct anything (else identity)."""
        return len(self._obs) >= self.min_samples

    def _coefficients(self) -> tuple[float, float, float]:
        """(fixed, scale, the largest prediction they hold for)."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float, float]:
        if len(self._obs) < self.min_samples:
            return 0.0, 1.0, math.inf
        x = np.array([a for a, _ in self._obs])
        y = np.array([b for _, b in self._obs])
        hi = float(x.max())
        if hi < 1.5 * float(x.min()):  # one size: an offset, unless predictions ran long
            offset = float(np.median(y - x))
            if offset >= 0:
                return offset, 1.0, hi
            return 0.0, max(self.MIN_SCALE, float(np.median(y / x))), hi
        fixed, scale = affine_fit(self._obs, (0.0, 1.0), min_slope=self.MIN_SCALE)
        # Least relative error runs short where first tokens scatter (queueing): with an
        # intercept, by 1.2-1.4x at the scatter of a loaded bench run. Centred on the median
        # of measured / corrected, half of the window came later than its correction, half
        # sooner (unless the scale then passes its bounds).
        centre = float(np.median(y / (fixed + scale * x)))
        fixed, scale = fixed * centre, scale * centre
        return fixed, min(max(scale, self.MIN_SCALE), self.MAX_SCALE), hi

    def apply(self, predicted_s: float) -> float:
        fixed, scale, hi = self._coefficients()
        if predicted_s <= hi:
            return fixed + scale * predicted_s
        return fixed + scale * hi + (predicted_s - hi)
