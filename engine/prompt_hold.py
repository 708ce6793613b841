"""A prompt's wait for the running decodes: where even the engine's smallest chunk beside them
takes a step past the step target, the prompts in line may wait instead, each at most its hold
(Request.prefill_hold_s, else SchedulerConfig.prefill_hold_s), while the decodes will end within
it. The time from a held step to the next counts against every prompt in line at it
(Request.held_s); one that has streamed tokens already (a decode preempted) never waits, as a
wait would be a gap in its stream. Part of the scheduler (engine/scheduler.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from engine.chunk_sizer import ChunkSizer
from engine.request import Request


class PromptHold:
    def __init__(self, default_s: float | None) -> None:
        self.default_s = default_s  # SchedulerConfig.prefill_hold_s
        self.steps = 0  # steps whose prompts waited for the decodes
        self._at: float | None = None  # when the latest step was scheduled, if it held
        self._ids: set[str] = set()  # the prompts in line at it

    def left(self, in_line: Sequence[Request]) -> float | None:
        """What is left of the hold to the prompt in `in_line` with the least of it, the held
        step running now counted: how long more prompts here may wait for decodes. 0 where one
        in line never waits (no hold, or it streamed already); None with no prompt in line."""
        if not in_line:
            return None
        least = self._least(in_line, time.monotonic())
        return 0.0 if least is None else max(0.0, least)

    def holds(
        self,
        decodes: Sequence[Request],
        in_line: Sequence[Request],
        sizer: ChunkSizer | None,
        kv_due: Iterable[Request],
    ) -> bool:
        """Whether this step's prompts (`in_line`: prefilling, then waiting) wait for the running
        `decodes`: even the smallest chunk beside them took a step past the target, and the
        longest of them (and of the handoffs whose KV may land now, `kv_due`, about to decode),
        at the decode steps measured, ends within what is left of the hold of every prompt in
        line."""
        if sizer is None:  # no target: nothing to count
            self._at = None
            return False
        now = time.monotonic()
        if self._at is not None:
            for r in in_line:
                r.held_s += self._now(r, now)
            self._at, self._ids = None, set()
        if not decodes or not in_line or sizer.fits():
            return False
        least = self._least(in_line, now)
        if least is None:  # one that never waits: none does
            return False
        # Before a decode-only step was measured, the smallest chunk's step (longer) stands in.
        per_token = sizer.decode_s if sizer.decode_s is not None else sizer.floor_s
        assert per_token is not None  # not fits(): a floor was measured
        coming = [*decodes, *kv_due]
        left = max(r.sampling.max_tokens - r.num_output_tokens for r in coming)
        if left * per_token > least:
            return False
        self._at, self._ids = now, {r.request_id for r in in_line}
        self.steps += 1
        return True

    def _least(self, in_line: Iterable[Request], now: float) -> float | None:
        """The least of `_left` over `in_line`; None as soon as one never waits."""
        least = float("inf")
        for r in in_line:
            hold = self._left(r, now)
            if hold is None:
                return None
            least = min(least, hold)
        return least

    def _left(self, r: Request, now: float) -> float | None:
        """What is left of `r`'s hold; None where it never waits: no hold (or one of 0), or it
        has streamed tokens already."""
        limit = r.prefill_hold_s if r.prefill_hold_s is not None else self.default_s
        if not limit or r.num_output_tokens:
            return None
        return limit - r.held_s - self._now(r, now)

    def _now(self, r: Request, now: float) -> float:
        """The time of the held step running now that counts against `r` (0: not held at it)."""
        if self._at is not None and r.request_id in self._ids:
            return now - self._at
        return 0.0
