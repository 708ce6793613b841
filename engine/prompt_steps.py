"""How many tokens of later prompts may join a step of prompts alone that completes one.

A step takes about a + b * tokens (a: its fixed cost; b: each token's). Filling the budget of a
step that completes a prompt with f tokens of the prompts behind it delays that prompt's first
token by b * f; not filling them costs each of the k prompts behind it at most one more step's
fixed cost, a (they need no fewer tokens computed). So such a step takes at most k * a / b
tokens of them: the least total wait. Where steps are bound by compute (a CPU: milliseconds of
fixed cost, milliseconds per token) that is a few tokens, and a prompt's first token no longer
waits for a full budget of the next prompts' chunks; where they are bound by launches or weights
(a GPU with a small batch: tokens nearly free) it is more than the budget, and the steps fill as
before. a and b are fit (least squares) to the latest steps of prompts alone; until those vary
enough in size for a fit that explains them, the steps fill as before.
"""

from __future__ import annotations

import statistics
from collections import deque

# The latest steps of prompts alone that the fit uses.
FIT_STEPS = 32
# Fit only over at least this many steps, whose largest ran at least SPREAD x the smallest's
# tokens, and use the fit only where the tokens explain at least R2 of the steps' variance: else
# the slope is noise (a tiny model's steps cost the same at any size, give or take jitter).
MIN_STEPS = 8
SPREAD = 2.0
R2 = 0.5


class PromptStepCost:
    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=FIT_STEPS)
        self.fixed_s: float | None = None  # a
        self.per_token_s: float | None = None  # b
        # a / b, the fixed cost in tokens; None: no cap (not fit yet, or tokens cost nothing)
        self.fixed_tokens: float | None = None

    def reset(self) -> None:
        """Forget the steps seen (they ran first shapes, slow once: the worker's warm-up)."""
        self._steps.clear()
        self.fixed_s = self.per_token_s = self.fixed_tokens = None

    def fill_cap(self, behind: int) -> int | None:
        """The most tokens of the `behind` prompts after a prompt that completes in a step of
        prompts alone that may join that step (None: no cap)."""
        if self.fixed_tokens is None:
            return None
        return int(max(1, behind) * self.fixed_tokens)

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """A step just run: only steps of prompts alone count."""
        if decodes or prefill_tokens <= 0 or seconds <= 0:
            return
        self._steps.append((prefill_tokens, seconds))
        self._fit()

    def _fit(self) -> None:
        xs = [x for x, _ in self._steps]
        if len(xs) < MIN_STEPS or max(xs) < SPREAD * min(xs):
            return
        ys = [y for _, y in self._steps]
        b, a = statistics.linear_regression(xs, ys)
        self.fixed_s, self.per_token_s = a, b
        # b > 0: the times vary, so their correlation with the tokens is defined.
        explained = statistics.correlation(xs, ys) ** 2 if b > 0 else 0.0
        self.fixed_tokens = None if explained < R2 else max(0.0, a / b)
