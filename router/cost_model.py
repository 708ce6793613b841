"""The step-time model: what a worker's steps take, fitted from the steps it measured (what each
path would cost a request, router/placement_costs.py, is priced from it).

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
attention reads every context token's K and V). The fit is a ridge regression (router/fits.py)
pulled toward that seed (a few pseudo-observations' worth), with older steps decaying, so early
predictions are roofline and later ones are measured.

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

The exposed KV transfer time is a second model (router/handoff_model.py), fitted from the
prefill workers' latest transfers.

Workers on one node share more than their own devices (its cores and memory bandwidth where they
run on CPUs): a worker's steps run slower while a peer on its node is busy. router/host_share.py
measures by how much; each worker's model is fitted on its steps with that share divided out, and
its predictions carry it (`StepTimeModel.scale`) while a peer is busy.

TTFT predictions also carry a per-path correction (router/ttft_bias.py), which absorbs what
neither model sees.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from engine.config import MIN_CHUNK
from engine.step_stats import StepStat
from router.fits import OnlineRidge
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
