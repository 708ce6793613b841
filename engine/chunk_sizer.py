"""How many prefill tokens a step beside running decodes may take to keep to a step target, and
how short such a step gets at the smallest chunk (engine/scheduler.py uses both: the chunk it
cuts, and whether prompts wait for the decodes instead)."""

from __future__ import annotations

from collections import deque

from engine.config import MIN_CHUNK

# How many of the latest smallest-chunk steps set ChunkSizer.floor_s (the longest of them).
FLOOR_STEPS = 8
# The weight of each new decode-only step in ChunkSizer.decode_s.
DECODE_SMOOTHING = 0.2


class ChunkSizer:
    """How many prefill tokens a step next to running decodes may take to last `target_s`.

    A step's time is about a + b * tokens (a: the decodes and fixed costs). Scaling the last
    chunk by target / measured time is a fixed-point iteration whose fixed point is the chunk
    that takes `target_s` ((target - a) / b), and whose error shrinks by a / target each step; it
    follows a and b as batches and prompt positions change. Growth is capped at 2x a step, so a
    wrong guess costs one slow step at most; a step over the target shrinks the chunk at once."""

    def __init__(self, target_s: float, budget: int) -> None:
        self.target_s = target_s
        self.budget = budget
        self.chunk = min(budget, 4 * MIN_CHUNK)  # a first guess, small: learned up from there
        # The latest steps that ran a chunk of MIN_CHUNK // 2 to MIN_CHUNK tokens beside decodes
        # (seconds): as short as a step with a prefill in it gets here, whatever the target.
        self._floor: deque[float] = deque(maxlen=FLOOR_STEPS)
        self.decode_s: float | None = None  # decode-only steps, smoothed

    @property
    def floor_s(self) -> float | None:
        """The longest of the latest steps that ran the smallest chunks beside decodes: an ITL
        SLO holds a request's p99 gap, which the slow ones among such steps set (on a CPU host
        a 16-token chunk beside one decode took 133 ms at the median and past 160 ms often)."""
        return max(self._floor) if self._floor else None

    def fits(self) -> bool:
        """Whether a step with a chunk beside decodes can keep to the target (unknown: yes)."""
        floor = self.floor_s
        return floor is None or floor <= self.target_s

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if decodes == 0 or seconds <= 0:
            return
        if prefill_tokens == 0:
            old = self.decode_s
            self.decode_s = seconds if old is None else old + DECODE_SMOOTHING * (seconds - old)
            return
        if MIN_CHUNK // 2 <= prefill_tokens <= MIN_CHUNK:
            self._floor.append(seconds)
        # Only steps that ran decodes next to most of a chunk say what a chunk costs (the tail
        # of a prompt, a few tokens, would say the fixed costs alone).
        if prefill_tokens < max(1, self.chunk // 2):
            return
        want = prefill_tokens * self.target_s / seconds
        self.chunk = round(max(MIN_CHUNK, min(self.budget, want, 2 * self.chunk)))
