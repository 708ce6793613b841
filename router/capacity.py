"""How many workers the decodes need at the rate requests arrive.

Each placement is chosen one request at a time (router/policy.py), and one request's view misses
what a decode worker's batch becomes. With decodes gathered on one worker of both kinds, setting
a second one decoding slows the first one's steps where they share a node (HostShare: 1.25x on a
2-core CPU node), which every running request there pays at once, while the gain (a batch half
as large for every request to come) is not any one request's. Gathering then wins each decision
while the gathered batch grows until its steps alone take every request past its ITL SLO.

`DecodeDemand` looks at the steady state instead. Requests arrive at rate `rate()` and decode
`output_len()` tokens each; spread over k decode workers, each worker's batch n satisfies
Little's law, n = (rate / k) x output_len x gap(n), where gap(n) is its decode step at batch n
(the step-time model, with its node's share where the k workers share a node) as a gap (times
the worker's gaps over steps), and its requests' p99 gap is that times the worker's tail. The
decodes need the fewest k whose p99 holds the ITL SLO; the router keeps them on that many
workers (the k with the most decodes, see Planner.candidates), and setting one of those decoding
costs the others no share-counted misses: at this rate they would see more from the batch that
gathering builds.

The prompts must still be prefilled somewhere. Where every worker that can prefill would then
decode too, each prompt's chunks run beside decodes, which cost the requests there their p99 gap
whatever batch they were spared (BENCHMARKS.md). So where no dedicated prefill worker remains,
the worker able to prefill with the fewest decodes stays out of those the decodes spread over:
two workers of both kinds keep the split."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from router.host_share import PeerWork
from router.pool_state import WorkerState

# The arrivals of the last WINDOW_S set the rate, once MIN_ARRIVALS came (before: one worker).
WINDOW_S = 60.0
MIN_ARRIVALS = 8
# Fixed-point iterations for the steady-state batch (it settles in a few; one still moving after
# these, or past the worker's max_num_seqs, grows without end).
ITERATIONS = 30


class DecodeDemand:
    def __init__(self, window_s: float = WINDOW_S, min_arrivals: int = MIN_ARRIVALS) -> None:
        self.window_s, self.min_arrivals = window_s, min_arrivals
        # (time.monotonic(), prompt tokens, max_tokens) of the requests taken within the window
        # (older ones leave as it moves on), and when the first of all came.
        self._arrivals: deque[tuple[float, int, int]] = deque()
        self._first: float | None = None
        self._outputs: deque[int] = deque(maxlen=64)  # tokens of the latest requests that ended

    def arrived(self, prompt_len: int, max_tokens: int, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        if self._first is None:
            self._first = t
        self._arrivals.append((t, prompt_len, max_tokens))

    def ended(self, output_tokens: int) -> None:
        if output_tokens > 0:
            self._outputs.append(output_tokens)

    def _recent(self, now: float) -> deque[tuple[float, int, int]]:
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()
        return self._arrivals

    def rate(self, now: float | None = None) -> float:
        """Requests per second over the window (or since the first arrival, if sooner); 0 with
        fewer than `min_arrivals`."""
        now = time.monotonic() if now is None else now
        recent = self._recent(now)
        if len(recent) < self.min_arrivals or self._first is None:
            return 0.0
        span = min(self.window_s, now - self._first)
        return len(recent) / span if span > 0 else 0.0

    def output_len(self, now: float | None = None) -> float:
        """Tokens a request decodes: the mean of those that ended lately, else of what the
        recent ones asked for."""
        if self._outputs:
            return sum(self._outputs) / len(self._outputs)
        recent = self._recent(time.monotonic() if now is None else now)
        return sum(a[2] for a in recent) / len(recent) if recent else 0.0

    def prompt_len(self, now: float | None = None) -> float:
        recent = self._recent(time.monotonic() if now is None else now)
        return sum(a[1] for a in recent) / len(recent) if recent else 0.0

    def p99_gap(
        self, w: WorkerState, rate: float, output_len: float, context: float, share: float = 1.0
    ) -> float:
        """The p99 gap on `w` in steady state with decodes arriving at `rate` (per second), each
        `output_len` tokens long at mean context `context`, its steps `share` times slower than
        alone; inf where its batch would outgrow max_num_seqs."""
        slower = share / w.model.scale  # its predictions carry the share for what runs now
        limit = w.info.max_num_seqs
        batch = 1
        for _ in range(ITERATIONS):
            step = w.model.decode_step_s(batch, round(batch * context)) * slower
            gap = step * w.gap_factor()
            n = rate * output_len * gap
            if n > limit:
                return float("inf")
            if max(1, round(n)) == batch:  # settled
                return gap * w.gap_tail()
            batch = max(1, round(n))
        return float("inf")  # still moving: a batch that keeps growing

    def needed(
        self,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        slo_itl_s: float,
        now: float | None = None,
    ) -> list[WorkerState]:
        """The decode workers the decodes need now (`workers_needed`), those with the most
        decodes first; where every worker able to prefill decodes too, the one of them with the
        fewest decodes stays out, free to prefill."""
        gathering = sorted(decode, key=lambda d: -(d.batch + d.local_prefills))
        decoding = {id(d) for d in decode}
        if prefill and all(id(p) in decoding for p in prefill) and len(gathering) > 1:
            able = {id(p) for p in prefill}
            free = next(d for d in reversed(gathering) if id(d) in able)
            gathering = [d for d in gathering if d is not free]
        return gathering[: self.workers_needed(gathering, slo_itl_s, now)]

    def workers_needed(
        self, workers: Sequence[WorkerState], slo_itl_s: float, now: float | None = None
    ) -> int:
        """The fewest of `workers` (taken in order: those already decoding first) over which
        the decodes, arriving at the current rate, see p99 gaps within `slo_itl_s`; where none
        do, the count with the shortest; 1 before the rate is known."""
        rate = self.rate(now)
        if rate <= 0 or not workers:
            return 1
        out_len = self.output_len(now)
        context = self.prompt_len(now) + out_len / 2
        best, best_p99 = 1, float("inf")
        for k in range(1, len(workers) + 1):
            chosen = workers[:k]
            p99 = max(
                self.p99_gap(w, rate / k, out_len, context, _node_share(w, chosen)) for w in chosen
            )
            if p99 <= slo_itl_s:
                return k
            if p99 < best_p99:
                best, best_p99 = k, p99
        return best


def _node_share(w: WorkerState, decoding: Sequence[WorkerState]) -> float:
    """How much slower `w`'s decode steps run with `decoding` (the workers set decoding) than
    with its peers idle: the node's decode share where another of them shares its node."""
    node = w.info.node_ip
    if node and any(o is not w and o.info.node_ip == node for o in decoding):
        return w.host.factor(PeerWork.DECODE)
    return 1.0
