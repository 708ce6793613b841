"""Each worker's step target, tuned from the tail of the inter-token gaps its requests see.

A worker with a step target cuts the prefill chunks it runs beside its decodes so that a step
takes about that long (engine/scheduler.py, ChunkSizer). The right target is not a fixed number:
what a request sees between two tokens is more than one step (the chunk's way to the router, the
slowest step at a prompt's end, two prefills' tails in one step), and what it must see is its ITL
SLO at the 99th percentile. So the router, which takes every chunk, measures the gaps per worker
(`MeasuredGaps.observe_gaps`), and every `interval_s`, for a worker whose last `window_s` hold at
least `min_gaps` gaps:

    ratio  = p99 of those gaps / the ITL SLO (the tightest among the requests decoding there,
             or queued there for a colocated prefill, that can still attain)
    most   = SLO / the worker's gaps over its steps (MeasuredGaps.gap_factor)
    target = clip(target * clip(goal / ratio, 0.7, 1.25), min(target, floor * most), most)

that is, a p99 above `goal` of the SLO shrinks the target, one below lets it grow back (cheaper
prefills: fewer, larger chunks), by at most 30% down and 25% up at a time, never past the step
whose gaps would take the SLO. A worker is retargeted at most once per half window, only by more
than 5%, and from the gaps measured since its last change alone (those under the old target say
nothing of the new one). A target past that step for the SLO of the requests decoding there (the
server's default SLO may be far looser than what its clients ask for) drops to `start` x it at
once. A worker where no such request decodes, or will, keeps its target: there is nothing there
to tune for, and tuning it to the server's default SLO (1 s) would set it for requests that are
not there, past what the next one placed there may ask for. The floor only stops a shrink: a
target under a loose SLO's floor grows back 25% at a time, as any other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from router.pool_state import WorkerState


@dataclass(frozen=True, slots=True)
class StepTargetConfig:
    interval_s: float = 2.0
    window_s: float = 20.0
    min_gaps: int = 50
    goal: float = 0.9  # the p99 gap aimed at, as a fraction of the ITL SLO
    # The least target, and where a target past the step whose gaps take the SLO (the SLO over
    # the worker's gaps over its steps) starts again: fractions of that step.
    floor: float = 0.2
    start: float = 0.8


class StepTargets:
    def __init__(self, config: StepTargetConfig | None = None) -> None:
        self.config = config or StepTargetConfig()
        self._next = 0.0
        self._changed: dict[str, float] = {}  # worker -> when it was last retargeted

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return False
        self._next = now + self.config.interval_s
        return True

    def retarget(self, state: WorkerState, now: float | None = None) -> float | None:
        """The worker's new step target, or None to leave it as it is."""
        c = self.config
        now = time.monotonic() if now is None else now
        target = state.model.step_target_s
        if target is None:
            return None
        # The requests decoding there, and those to decode there once their local prefill is
        # done: a colocated prompt's own decode runs beside the prompts queued after it.
        slo = min([state.min_itl_slo_s, *state.coming_itl_slos()])
        if not math.isfinite(slo):
            return None  # none to tune for (nor to lose): the gaps were those of requests gone
        drop = self.for_request(state, slo)
        if drop is not None:
            return drop
        changed = self._changed.get(state.worker_id, -math.inf)
        if now - changed < c.window_s / 2:
            return None
        gaps = state.measured.recent_gaps(max(now - c.window_s, changed))  # under this target
        if len(gaps) < c.min_gaps:
            return None
        p99 = float(np.percentile(gaps, 99))
        factor = min(1.25, max(0.7, c.goal * slo / p99)) if p99 > 0 else 1.25
        most = _slo_step(state, slo)
        # The floor stops a shrink; it never raises a target (one under a loose SLO's floor,
        # kept from a tighter request, grows by 25% at most like any other).
        new = min(most, max(min(target, c.floor * most), target * factor))
        if abs(new / target - 1) <= 0.05:
            return None
        return new

    def for_request(self, state: WorkerState, slo_itl_s: float) -> float | None:
        """The worker's new step target for a request with ITL SLO `slo_itl_s` that decodes
        there or is placed there (None: leave it): a target past the step whose gaps take that
        SLO (the SLO over the worker's gaps over its steps) drops to `start` x that step at
        once. The router calls it at placement too, before the request's prefill runs:
        the tuning above sees a request only once it decodes, and its first chunks, and those
        of the prompts queued with it, would run at the old target (a server's default SLO may
        be far looser than what its clients ask for)."""
        target = state.model.step_target_s
        if target is None or not math.isfinite(slo_itl_s):
            return None
        most = _slo_step(state, slo_itl_s)
        return self.config.start * most if target > most else None

    def changed(self, worker_id: str, now: float | None = None) -> None:
        """The worker took its new target (call once it did)."""
        self._changed[worker_id] = time.monotonic() if now is None else now


def _slo_step(state: WorkerState, slo_s: float) -> float:
    """The step on `state` whose gaps take `slo_s` (the SLO over its gaps over its steps)."""
    return slo_s / state.measured.gap_factor()
