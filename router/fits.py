"""Two fits the cost model's parts share: a ridge regression with forgetting pulled toward a
prior (the step-time model, router/cost_model.py), and an affine fit by least relative error
(the transfer model, router/handoff_model.py; the TTFT bias, router/ttft_bias.py)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class OnlineRidge:
    """Least squares with exponential forgetting, pulled toward a prior: minimises
    sum_i decay^age_i (y_i - x_i.w)^2 + decay^n sum_j p_j (w_j - prior_j)^2. The prior acts as
    pseudo-observations made before the first real one, and ages like them: it decides the first
    predictions and fades as measurements come. Coefficients are kept >= 0."""

    def __init__(self, prior: np.ndarray, typical: np.ndarray, strength: float, decay: float):
        """`strength` pseudo-observations of each feature alone at its `typical` value."""
        self.prior = prior.astype(np.float64)
        self.p = np.diag(strength * typical.astype(np.float64) ** 2)
        self.decay = decay
        self.xtx = np.zeros((len(prior), len(prior)))
        self.xty = np.zeros(len(prior))
        self.n = 0
        self._w: np.ndarray | None = None

    def observe(self, x: np.ndarray, y: float) -> None:
        self.xtx *= self.decay
        self.xty *= self.decay
        self.p *= self.decay
        self.xtx += np.outer(x, x)
        self.xty += x * y
        self.n += 1
        self._w = None

    @property
    def w(self) -> np.ndarray:
        if self._w is None:
            self._w = self._solve()
        return self._w

    def _solve(self) -> np.ndarray:
        """Non-negative: a coefficient the unconstrained fit makes negative is fixed at 0 and
        the rest refitted without it (most negative first), until none is."""
        a = self.xtx + self.p
        b = self.xty + self.p @ self.prior
        free = list(range(len(b)))
        w = np.zeros(len(b))
        while free:
            sol = np.linalg.solve(a[np.ix_(free, free)], b[free])
            if (sol >= 0).all():
                w[free] = sol
                break
            free.pop(int(np.argmin(sol)))
        return w


def affine_fit(
    obs: Iterable[tuple[float, float]], seed: tuple[float, float], min_slope: float = 0.0
) -> tuple[float, float]:
    """(intercept >= 0, slope >= min_slope) of y = intercept + slope * x over (x > 0, y > 0)
    pairs, by least relative error. With one size of x (within 1.5x), the intercept can't be told
    from the slope: the seed's intercept (at most half the least y), the slope from it; without a
    pair, the seed."""
    pairs = list(obs)
    if not pairs:
        return seed
    x = np.array([a for a, _ in pairs])
    y = np.array([b for _, b in pairs])
    if x.max() < 1.5 * x.min():
        fixed = min(seed[0], float(y.min()) / 2)
        return fixed, max(min_slope, float(np.mean((y - fixed) / x)))
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]  # rows scaled: relative error
    fixed, slope = np.linalg.lstsq(a, np.ones_like(y), rcond=None)[0]
    if slope <= min_slope:  # no visible (or too little) size effect: the rest is fixed
        return max(0.0, float(np.mean(y - min_slope * x))), min_slope
    if fixed < 0:  # no visible fixed part: all slope
        return 0.0, max(min_slope, float(np.mean(y / x)))
    return float(fixed), float(slope)
