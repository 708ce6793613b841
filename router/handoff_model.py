"""What a handoff costs besides its prefill: the exposed KV transfer time (first token sampled
-> send ended; layer-wise streaming hides the rest behind the prefill), a linear model
`latency + bytes / bandwidth` fitted from the prefill workers' latest transfer measurements and
seeded from a nominal bandwidth; and how often each pair's handoffs fall back lately
(`HandoffHealth`), with what a failed one wastes."""

from __future__ import annotations

import math
import time
from collections import deque

from router.fits import affine_fit


class TransferTimeModel:
    """Exposed KV transfer time, latency + bytes / bandwidth: a fit of the latest `window`
    measurements, weighing relative errors (sizes span orders of magnitude); the seed stands in
    until two sizes have been seen, and supplies the latency while all sizes are alike."""

    def __init__(
        self, bandwidth_bytes_s: float = 1e9, latency_s: float = 0.005, window: int = 32
    ) -> None:
        self.seed = (latency_s, 1.0 / bandwidth_bytes_s)
        self._obs: deque[tuple[float, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = self.seed

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._obs.append((float(nbytes), seconds))
            self._fit = None

    def _coefficients(self) -> tuple[float, float]:
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        return affine_fit(self._obs, self.seed)

    @property
    def bandwidth_bytes_s(self) -> float:
        per_byte = self._coefficients()[1]
        return 1.0 / per_byte if per_byte > 0 else math.inf

    @property
    def latency_s(self) -> float:
        return self._coefficients()[0]

    def seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        lat, per_byte = self._coefficients()
        return lat + per_byte * nbytes


class HandoffHealth:
    """How often each (prefill, decode) pair's handoffs fall back to a local prefill lately, and
    what a failed one wastes before the decode worker starts on it.

    The failure rate is an average over the pair's recent handoffs (each new one weighs
    `alpha`) that decays toward 0 with `half_life_s` since the last one: a pair that kept failing
    is avoided for a while, then tried again (a fallback then costs what it wasted, which for a
    pair known broken is nothing, plus the local prefill the request gets anyway)."""

    def __init__(self, alpha: float = 0.5, half_life_s: float = 60.0) -> None:
        self.alpha = alpha
        self.half_life_s = half_life_s
        self._rate: dict[tuple[str, str], tuple[float, float]] = {}  # pair -> (rate, at)
        self._wasted: dict[tuple[str, str], float] = {}

    def observe(
        self, p: str, d: str, ok: bool, wasted_s: float = 0.0, now: float | None = None
    ) -> None:
        now = time.monotonic() if now is None else now
        rate = self.failure_rate(p, d, now)
        self._rate[(p, d)] = (rate + self.alpha * ((0.0 if ok else 1.0) - rate), now)
        if not ok:
            before = self._wasted.get((p, d), wasted_s)
            self._wasted[(p, d)] = before + self.alpha * (wasted_s - before)

    def failure_rate(self, p: str, d: str, now: float | None = None) -> float:
        rate, at = self._rate.get((p, d), (0.0, 0.0))
        if rate == 0.0:
            return 0.0
        now = time.monotonic() if now is None else now
        return rate * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def wasted_s(self, p: str, d: str) -> float:
        return self._wasted.get((p, d), 0.0)

    def forget(self, worker_id: str) -> None:
        """A worker was replaced: its pairs start afresh."""
        for key in [k for k in self._rate if worker_id in k]:
            self._rate.pop(key, None)
            self._wasted.pop(key, None)
