"""The handoff cost model: what each path would cost a request, from measured step times.

One linear model of a worker's step time, fitted online from the steps the worker reports
(engine/step_stats.py), prices everything:

    step_s = w0 + w1 * tokens + w2 * prefill_pairs + w3 * decode_context

  - prefill of n uncached tokens after c cached ones, alone in one step:
        w0 + w1*n + w2*n*(c + (n+1)/2)            (the issue's a + b*n + c*n^2)
  - decode step of a batch of B with context sum S:   w0 + w1*B + w3*S
  - a chunked local prefill next to B decodes: ceil(tokens / (budget - B)) steps, each
    paying the decode batch too; the decodes' ITL during it is one such step (interference).

The seed is a roofline from the device rates each worker measures at start: w0 = weight bytes /
memory bytes/s (a step reads every weight), w1 = 2 * params / FLOP/s, w2 = 4 * layers * heads *
head_dim / FLOP/s (QK^T and PV of a prefill), w3 = KV bytes per token / memory bytes/s (decode
attention reads every context token's K and V). The fit is a ridge regression pulled toward that
seed (a few pseudo-observations' worth), with older steps decaying, so early predictions are
roofline and later ones are measured.

A fit prices well only the kinds of step it has seen: fitted on prefill chunks alone (a worker of
both kinds that has only prefilled for its peers), w0 and w3 are a few milliseconds of the chunks'
seconds and go unmeasured, and its decode steps come out several times too short (135M on a CPU
core: 5 ms predicted for a 42 ms step). Each model counts the steps of each kind it has seen lately
(`support`: with prefill tokens; decodes alone), decayed as its fit. A step with prefill tokens
takes w0 and its prefill part (w1*tokens + w2*pairs) from the prefill fit, its decodes (w1*B +
w3*S) from the decode fit; a step of decodes alone takes all from the decode fit. Each is the
worker's own where it has seen MIN_SUPPORT steps of that kind, else the fit of the kin (a worker
running the same model on the same kind of device: `kin_of`) that has seen the most, where it has
seen as many. A step beside a chunk costs no less per step than one of decodes alone.

The exposed KV transfer time (first token sampled -> send ended; layer-wise streaming hides the
rest behind the prefill) is a second linear model, `latency + bytes / bandwidth`, fitted from the
prefill worker's latest transfer measurements and seeded from a nominal bandwidth.

Workers on one node share more than their own devices (its cores and memory bandwidth where they
run on CPUs): a worker's steps run slower while a peer on its node is busy. router/host_share.py
measures by how much; each worker's model is fitted on its steps with that share divided out, and
its predictions carry it (`StepTimeModel.scale`) while a peer is busy.

TTFT predictions also carry a per-path correction (`Bias`: measured = fixed + scale x predicted,
fitted over the path's latest first tokens), which absorbs what neither model sees: RPC hops,
token delivery, the engine thread's wake-up, queues over- or under-estimated.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from engine.config import MIN_CHUNK
from engine.step_stats import StepStat
from worker_protocol.messages import WorkerInfo

NUM_FEATURES = 4
# Steps a worker's model has seen before its predictions are compared with measured steps
# (router/host_share.py).
SETTLED_STEPS = 100
# Steps of a kind (with prefill tokens; decodes alone) a worker's fit must have seen lately for
# the part of a step that kind prices to come from its own fit (see the module docstring).
MIN_SUPPORT = 10.0
PREFILL, DECODE = 0, 1
# Workers whose devices measured rates within this factor of each other's are of one kind.
KIN_RATE_RATIO = 2.0


def kin_of(a: WorkerInfo, b: WorkerInfo) -> bool:
    """Whether `a` and `b` run the same model on the same kind of device: their steps of one
    shape take alike (what one has measured can price the other's)."""
    if (a.device, a.num_layers, a.num_params, a.weight_bytes, a.kv_bytes_per_token) != (
        b.device,
        b.num_layers,
        b.num_params,
        b.weight_bytes,
        b.kv_bytes_per_token,
    ):
        return False
    ratios = (a.rate.flops_per_s / b.rate.flops_per_s, a.rate.bytes_per_s / b.rate.bytes_per_s)
    return all(1 / KIN_RATE_RATIO <= r <= KIN_RATE_RATIO for r in ratios)


def prefill_pairs(n: int, cached: int) -> float:
    """Attention (query, key) pairs of prefilling n tokens after `cached` ones."""
    return n * (cached + (n + 1) / 2)


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


class StepCoefficients(NamedTuple):
    base_s: float  # w0: per step
    per_token_s: float  # w1
    per_prefill_pair_s: float  # w2
    per_context_token_s: float  # w3: per decode context token


class StepTimeModel:
    """One worker's step time (see the module docstring)."""

    def __init__(self, info: WorkerInfo, prior_steps: float = 3.0, decay: float = 0.995) -> None:
        rate = info.rate
        seed = np.array(
            [
                info.weight_bytes / rate.bytes_per_s,  # a step reads every weight once
                2.0 * info.num_params / rate.flops_per_s,
                4.0 * info.num_layers * info.num_heads * info.head_dim / rate.flops_per_s,
                info.kv_bytes_per_token / rate.bytes_per_s,  # decode reads each token's K, V
            ]
        )
        typical = np.array([1.0, 256.0, prefill_pairs(256, 0), 64.0 * 256])
        self.fit = OnlineRidge(seed, typical, prior_steps, decay)
        self.budget = info.max_num_batched_tokens
        self.step_target_s = info.step_target_s
        # The slowest of its latest smallest-chunk steps beside decodes (`chunk_floor_s`,
        # polled): decodes beside a chunk see no quicker steps (chunked_s), and prompts wait
        # for short decodes there (SchedulerConfig.prefill_hold_s) where it passes the target;
        # `decode_left`: the most tokens a request decoding there may still take (set by its
        # WorkerState; 0: unknown). See hold_wait_s.
        self.hold_s = info.prefill_hold_s
        self.chunk_floor_s: float | None = None
        self.decode_left = 0
        # What is left of the hold to the prompt in line there with the least of it (polled,
        # WorkerLoad.hold_left_s; None: no prompt in line): a prompt placed now waits no longer.
        self.hold_left_s: float | None = None
        # How much slower than alone its steps run now (a busy peer on its node: HostShare); the
        # fit holds its steps alone, predictions are multiplied by this.
        self.scale = 1.0
        self._w: StepCoefficients | None = None  # the fit as plain floats (predictions are hot)
        # The steps of each kind (PREFILL: with prefill tokens; DECODE: decodes alone) the fit
        # has seen, decayed as it is.
        self.support = [0.0, 0.0]
        # The models of its kin (`kin_of`), set by the router's membership: they price the part
        # of a step of a kind this one has not seen (see the module docstring).
        self.kin: Sequence[StepTimeModel] = ()
        # Per kind: (the kin priced from, its fit's step count, its coefficients times `scale`).
        self._borrowed: list[tuple[StepTimeModel, int, StepCoefficients] | None] = [None, None]

    def observe(self, s: StepStat, scale: float = 1.0) -> None:
        """A step the worker measured while its steps ran `scale` times slower than alone."""
        x = np.array([1.0, s.tokens, s.prefill_pairs, s.decode_context])
        self.fit.observe(x, s.seconds / scale)
        d = self.fit.decay
        prefill, decode = self.support
        self.support = [
            prefill * d + (s.prefill_tokens > 0),
            decode * d + (s.prefill_tokens == 0 and s.decode_seqs > 0),
        ]
        self._w = None

    def source(self, kind: int) -> StepTimeModel:
        """The model that prices the `kind` part of this worker's steps: its own where it has
        seen MIN_SUPPORT steps of that kind, else the kin that has seen the most, where it has
        seen MIN_SUPPORT (else itself)."""
        if self.support[kind] >= MIN_SUPPORT or not self.kin:
            return self
        best = max(self.kin, key=lambda m: m.support[kind])
        return best if best.support[kind] >= MIN_SUPPORT else self

    def _priced(self, kind: int) -> StepCoefficients:
        """The coefficients, times `scale`, that price the `kind` part of a step."""
        src = self.source(kind)
        if src is self:
            return self.coefficients
        held = self._borrowed[kind]
        if held is None or held[0] is not src or held[1] != src.fit.n:
            held = self._borrowed[kind] = (src, src.fit.n, self._scaled(src.fit.w))
        return held[2]

    @property
    def settled(self) -> bool:
        """Whether it has seen enough steps that its predictions are measured, not the seed."""
        return self.fit.n >= SETTLED_STEPS

    def alone_s(self, steps: Sequence[StepStat]) -> np.ndarray:
        """What the model predicts for the shapes of `steps`, each taken alone on its node."""
        shapes = [
            self._fixed(s.decode_seqs, s.decode_context, s.prefill_tokens > 0)
            + self._prefill_part(s.prefill_tokens, s.prefill_pairs)
            for s in steps
        ]
        return np.array(shapes) / self.scale

    @contextmanager
    def target_at_most(self, limit_s: float | None) -> Iterator[None]:
        """Predictions within it take the step target the worker will have once a request
        placed there brings it down to `limit_s` (None: as it is; see StepTargets.for_request)."""
        held = self.step_target_s
        if limit_s is not None and held is not None:
            self.step_target_s = min(held, limit_s)
        try:
            yield
        finally:
            self.step_target_s = held

    @contextmanager
    def decodes_left_at_least(self, tokens: int) -> Iterator[None]:
        """Predictions within it count one more decode of `tokens` tokens among those a prompt
        would wait for (a handoff placed there: the worker waits for it too once its KV lands)."""
        held = self.decode_left
        self.decode_left = max(held, tokens)
        try:
            yield
        finally:
            self.decode_left = held

    def set_scale(self, scale: float) -> None:
        if scale != self.scale:
            self.scale = scale
            self._w = None
            self._borrowed = [None, None]

    @property
    def coefficients(self) -> StepCoefficients:
        """The fit's coefficients times `scale`: its steps as they run now."""
        if self._w is None:
            self._w = self._scaled(self.fit.w)
        return self._w

    def _scaled(self, w: np.ndarray) -> StepCoefficients:
        """A fit's coefficients (steps alone) times `scale`, as plain floats."""
        return StepCoefficients(*(float(v) * self.scale for v in w))

    def _fixed(self, batch: int, context: int, prefill: bool) -> float:
        """A step's cost without its prefill tokens: its own per step and its `batch` decodes of
        total `context` (priced as decodes). A step with a `prefill` takes the prefill fit's own
        per step, and no less than the decode fit's where it has decodes (a step beside a chunk
        is no quicker than one without it)."""
        if not batch:
            return self._priced(PREFILL).base_s if prefill else 0.0
        w = self._priced(DECODE)
        base = max(w.base_s, self._priced(PREFILL).base_s) if prefill else w.base_s
        return base + w.per_token_s * batch + w.per_context_token_s * context

    def _prefill_part(self, tokens: int, pairs: float) -> float:
        """What `tokens` prefill tokens of `pairs` attention pairs add to a step."""
        if tokens <= 0:
            return 0.0
        w = self._priced(PREFILL)
        return w.per_token_s * tokens + w.per_prefill_pair_s * pairs

    def decode_step_s(self, batch: int, context: int) -> float:
        return self._fixed(batch, context, prefill=False) if batch else 0.0

    def prefill_s(self, n: int, cached: int = 0) -> float:
        """A prompt's prefill alone on an idle worker (chunked under the token budget)."""
        return self.chunked_s(n, prefill_pairs(n, cached), 0, 0)[0]

    def _chunk(self, tokens: int, pairs: float, batch: int, fixed: float) -> int:
        """The prefill chunk next to `batch` decodes whose step costs `fixed` without it."""
        chunk = max(1, self.budget - batch)
        if batch > 0 and self.step_target_s is not None:
            # The worker sizes chunks next to decodes (and handoffs whose KV may land, which
            # `batch` counts from their placement on: sooner than the worker, see Placement
            # kv_due_in_s) so that a step takes its target.
            w = self._priced(PREFILL)
            w1, w2 = w.per_token_s, w.per_prefill_pair_s
            per_token = w1 + w2 * pairs / tokens
            fit = (self.step_target_s - fixed) / per_token if per_token > 0 else chunk
            chunk = int(min(chunk, max(MIN_CHUNK, fit)))
        return chunk

    def _plan(self, tokens: int, pairs: float, batch: int, context: int) -> tuple[float, int, int]:
        """(the step's cost without the prefill, the chunk, the steps) for `tokens` prefill
        tokens (> 0) in chunks next to `batch` decodes of total context `context`."""
        fixed = self._fixed(batch, context, prefill=True)
        chunk = self._chunk(tokens, pairs, batch, fixed)
        return fixed, chunk, math.ceil(tokens / chunk)

    def chunk_steps(self, tokens: int, pairs: float, batch: int, context: int) -> int:
        """How many steps `tokens` prefill tokens take in chunks next to `batch` decodes."""
        return self._plan(tokens, pairs, batch, context)[2] if tokens > 0 else 0

    def hold_wait_s(self, batch: int, context: int, hold_s: float | None = None) -> float | None:
        """How long a prompt placed now waits for the `batch` decodes running (of total
        `context`) to end, where the worker holds prompts for them (SchedulerConfig
        prefill_hold_s: its smallest chunks beside decodes took steps past the step target, and
        the longest of them, `decode_left` decode steps, ends within what is left of the hold
        to every prompt in line there, and to the prompt placed now, whose hold is `hold_s`;
        None: no prompt is placed now, only those in line wait, or else one with the worker's
        own hold); None where it chunks beside them."""
        left = self.hold_left_s
        limit: float | None
        if hold_s is not None:
            limit = hold_s if left is None else min(hold_s, left)
        else:
            limit = left if left is not None else self.hold_s
        if not batch or not self.decode_left or not limit or limit <= 0:
            return None
        target, floor = self.step_target_s, self.chunk_floor_s
        if target is None or floor is None or floor <= target:
            return None
        wait = self.decode_left * self.decode_step_s(batch, context)
        return wait if wait <= limit else None

    def chunked_s(
        self, tokens: int, pairs: float, batch: int, context: int, hold_s: float | None = None
    ) -> tuple[float, float]:
        """(time to compute `tokens` prefill tokens in chunks next to `batch` decodes of total
        context `context`, the step time those decodes see meanwhile). Where the worker holds
        prompts for its decodes (hold_wait_s, with the hold `hold_s` of the prompt placed now;
        None: the worker's own), the prompts wait them out and then run alone,
        and the decodes' steps stay their own. The step the decodes see is no quicker than the
        worker's measured `chunk_floor_s`; the prefill's time is not raised to it: the floor is
        the slowest of eight such steps, standing for a p99 gap, where the prefill's time is a
        sum of steps."""
        if tokens <= 0:
            return 0.0, self.decode_step_s(batch, context)
        wait = self.hold_wait_s(batch, context, hold_s)
        if wait is not None:
            return wait + self.chunked_s(tokens, pairs, 0, 0)[0], self.decode_step_s(batch, context)
        _, w1, w2, _ = self._priced(PREFILL)
        fixed, chunk, steps = self._plan(tokens, pairs, batch, context)
        total = steps * fixed + w1 * tokens + w2 * pairs
        during = fixed + w1 * min(chunk, tokens) + w2 * pairs / steps
        if batch > 0 and self.step_target_s is not None:
            # What the decodes see is the slowest step, at a prompt's end, where a token's
            # attention costs about twice the average; there the worker shrinks the chunk to hold
            # the target, down to MIN_CHUNK tokens, past which the target gives way.
            at_end = fixed + min(MIN_CHUNK, tokens) * (w1 + 2.0 * w2 * pairs / tokens)
            during = max(during, at_end)
            if self.chunk_floor_s is not None:
                # Measured there: the slowest of the latest steps with the smallest chunks
                # beside decodes (the worker's chunks never shrink past them).
                during = max(during, self.chunk_floor_s)
        return total, during


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
