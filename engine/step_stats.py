"""What each executed step cost: the shape of its work and its wall time, for the router's
step-time model (a linear fit over these features, see router/cost_model.py).

Features of a step, as the model reads them:
  - tokens: every token computed (decode tokens + prefill chunk tokens): the matmul rows;
  - prefill_pairs: (query, key) pairs of attention over prefill chunks, sum of
    chunk * (cached + (chunk + 1) / 2): quadratic in a prompt's length;
  - decode_context: sum of the decoding requests' context lengths (decode attention reads).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.outputs import SchedulerOutput

MAX_KEPT = 256  # steps kept between two reads; older ones are dropped, not summed


@dataclass(frozen=True, slots=True)
class StepStat:
    tokens: int
    prefill_tokens: int
    prefill_pairs: float
    decode_seqs: int
    decode_context: int
    seconds: float


def step_stat(so: SchedulerOutput, seconds: float) -> StepStat:
    prefill_tokens = 0
    pairs = 0.0
    decode_seqs = 0
    decode_ctx = 0
    for s in so.scheduled:
        n = len(s.token_ids)
        if n == 1 and s.sample and s.start_pos > 0:
            decode_seqs += 1
            decode_ctx += s.start_pos + 1
        else:
            prefill_tokens += n
            pairs += n * (s.start_pos + (n + 1) / 2)
    return StepStat(
        tokens=prefill_tokens + decode_seqs,
        prefill_tokens=prefill_tokens,
        prefill_pairs=pairs,
        decode_seqs=decode_seqs,
        decode_context=decode_ctx,
        seconds=seconds,
    )


class StepRecorder:
    """The latest steps, handed out once each by `drain()`, and the totals since the engine
    started or its totals were reset (LLMEngine.reset_totals): steps run and the seconds they
    took (`busy_s`: the model runner's part of each
    step as the host times it, scheduling and output handling left out; over wall time, a lower
    bound on how busy the engine was)."""

    def __init__(self) -> None:
        self._steps: deque[StepStat] = deque(maxlen=MAX_KEPT)
        self.total_steps = 0
        self.busy_s = 0.0

    def record(self, so: SchedulerOutput, seconds: float) -> StepStat:
        stat = step_stat(so, seconds)
        self._steps.append(stat)
        self.total_steps += 1
        self.busy_s += seconds
        return stat

    def reset(self) -> None:
        """Count from zero again (the steps kept for reading dropped too)."""
        self.drain()
        self.total_steps = 0
        self.busy_s = 0.0

    def drain(self) -> tuple[StepStat, ...]:
        out = tuple(self._steps)
        self._steps.clear()
        return out
