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
workers (the k with the most decodes, see Candidates.candidates in router/candidates.py), and
setting one of those decoding costs the others no share-counted misses: at this rate they would
see more from the batch that gathering builds.

The prompts must still be prefilled somewhere. Where every worker that can prefill would then
decode too, each prompt's chunks run beside decodes, which cost the requests there their p99 gap
whatever batch they were spared (BENCHMARKS.md). So where no dedicated prefill worker remains,
the worker able to prefill with the fewest decodes stays out of those the decodes spread over:
two workers of both kinds keep the split.

Past what the decodes can hold, no placement helps: at the rate requests are taken, every count
of the workers that may decode gives a steady-state batch whose p99 gap passes the ITL SLO, and
every request decoding then misses it. Admission (router/admission.py) refuses a request whose
taking would set such a rate (`overload`) once the decodes there are as many as the workers
hold within the SLO (`holds`): the rate taken then settles where the decodes hold the SLO, and
those taken attain it rather than all missing together. Over the window's 10 s a burst at a
rate the decodes hold on average reads past it, and the batch it leaves is still short of what
they hold: it is taken.
Where prompts cannot be prefilled beside decodes (a CPU host: one 80-token prompt costs a decode
step several ITL SLOs), a pair of workers is the split, and this is what keeps it serving within
the SLO at a rate past its decode worker's."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from router.host_share import PeerWork
from router.pool_state import WorkerState

# The arrivals of the last WINDOW_S set the rate, once MIN_ARRIVALS came (before: one worker),
# over the time since the oldest of them, but never less than MIN_SPAN_S: a burst after a quiet
# spell reads as what it adds over that span, not as the rate within it. The window is about
# twice a request's life on a decode worker (100-200 tokens at 50-100 ms a gap): the time its
# batch takes to settle at a new rate.
WINDOW_S = 20.0
MIN_SPAN_S = 10.0
MIN_ARRIVALS = 8
# Fixed-point iterations for the steady-state batch (it settles in a few; one still moving after
# these, or past the worker's max_num_seqs, grows without end).
ITERATIONS = 30


@dataclass(frozen=True, slots=True)
class DecodeOverload:
    """A rate of requests taken (one more counted) that the decodes cannot hold: at best, over
    `workers` of those that may decode, their p99 gap in steady state is `p99_s`; and those that
    may decode already have as many decodes as they hold within the SLO."""

    rate: float
    workers: int
    p99_s: float
    # The decodes running and to come on those that may decode (handoffs placed, local
    # prefills queued), and the most they run within the SLO: refused only once the first
    # reaches the second.
    load: int
    room: int
    # How many decodes end per second with `room` of them running (each its output's steps
    # at the gap of that batch): about how often one more can be taken.
    ends_per_s: float = 0.0


class DecodeDemand:
    def __init__(
        self,
        window_s: float = WINDOW_S,
        min_arrivals: int = MIN_ARRIVALS,
        min_span_s: float = MIN_SPAN_S,
    ) -> None:
        self.window_s, self.min_arrivals, self.min_span_s = window_s, min_arrivals, min_span_s
        # (time.monotonic(), prompt tokens, max_tokens) of the requests taken within the window
        # (older ones leave as it moves on).
        self._arrivals: deque[tuple[float, int, int]] = deque()
        # (tokens decoded, max_tokens) of the latest requests that ended.
        self._outputs: deque[tuple[int, int]] = deque(maxlen=64)

    def arrived(self, prompt_len: int, max_tokens: int, now: float | None = None) -> None:
        """A request taken that asked for `max_tokens`; one of one token decodes nothing and
        is not counted (RequestShape.decodes), nor when it ends."""
        if max_tokens > 1:
            self._arrivals.append(
                (time.monotonic() if now is None else now, prompt_len, max_tokens)
            )

    def ended(self, output_tokens: int, max_tokens: int) -> None:
        if output_tokens > 0 and max_tokens > 1:
            self._outputs.append((output_tokens, max_tokens))

    def _recent(self, now: float) -> deque[tuple[float, int, int]]:
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()
        return self._arrivals

    def rate(self, now: float | None = None, extra: int = 0) -> float:
        """Requests per second taken within the window, over the time since the oldest of them
        (at least `min_span_s`), with `extra` more taken now; 0 with fewer than
        `min_arrivals`."""
        now = time.monotonic() if now is None else now
        recent = self._recent(now)
        if len(recent) < self.min_arrivals:
            return 0.0
        return (len(recent) + extra) / max(now - recent[0][0], self.min_span_s)

    def output_len(self, now: float | None = None) -> float:
        """Tokens a request decodes: what the recent ones asked for (max_tokens), times the
        share of what they asked for that the latest requests to end decoded. Not the mean of
        those that ended: short ones end first, and that mean runs short while a rate rises."""
        recent = self._recent(time.monotonic() if now is None else now)
        if not recent:
            return 0.0
        asked = sum(a[2] for a in recent) / len(recent)
        if not self._outputs:
            return asked
        return asked * sum(o for o, _ in self._outputs) / sum(m for _, m in self._outputs)

    def prompt_len(self, now: float | None = None) -> float:
        recent = self._recent(time.monotonic() if now is None else now)
        return sum(a[1] for a in recent) / len(recent) if recent else 0.0

    def context(self, now: float | None = None) -> float:
        """The mean context of a request decoding: its prompt and half of what it decodes."""
        return self.prompt_len(now) + self.output_len(now) / 2

    def p99_gap(
        self, w: WorkerState, rate: float, output_len: float, context: float, share: float = 1.0
    ) -> float:
        """The p99 gap on `w` in steady state with decodes arriving at `rate` (per second), each
        `output_len` tokens long at mean context `context`, its steps `share` times slower than
        alone; inf where its batch would outgrow max_num_seqs."""
        limit = w.info.max_num_seqs
        batch = 1
        for _ in range(ITERATIONS):
            gap = _gap(w, batch, context, share)
            n = rate * output_len * gap
            if n > limit:
                return float("inf")
            if max(1, round(n)) == batch:  # settled
                return gap * w.measured.gap_tail()
            batch = max(1, round(n))
        return float("inf")  # still moving: a batch that keeps growing

    def decoders(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState]
    ) -> list[WorkerState]:
        """The workers the decodes may spread over, those with the most decodes first: every
        decode worker, but where every worker able to prefill decodes too, the one of them
        with the fewest decodes stays out, free to prefill."""
        gathering = sorted(decode, key=lambda d: -(d.batch + d.local_prefills))
        decoding = {id(d) for d in decode}
        if prefill and all(id(p) in decoding for p in prefill) and len(gathering) > 1:
            able = {id(p) for p in prefill}
            free = next(d for d in reversed(gathering) if id(d) in able)
            gathering = [d for d in gathering if d is not free]
        return gathering

    def needed(
        self,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        slo_itl_s: float,
        now: float | None = None,
    ) -> list[WorkerState]:
        """The decode workers the decodes need now (`workers_needed`) of `decoders`."""
        gathering = self.decoders(prefill, decode)
        return gathering[: self.workers_needed(gathering, slo_itl_s, now)]

    def _p99_per_count(
        self, workers: Sequence[WorkerState], rate: float, now: float | None
    ) -> Iterator[tuple[int, float]]:
        """For k = 1.. len(workers): k and the p99 gap in steady state with the decodes at
        `rate` over the first k."""
        out_len = self.output_len(now)
        context = self.context(now)
        for k in range(1, len(workers) + 1):
            chosen = workers[:k]
            p99 = max(
                self.p99_gap(w, rate / k, out_len, context, _node_share(w, chosen)) for w in chosen
            )
            yield k, p99

    def workers_needed(
        self, workers: Sequence[WorkerState], slo_itl_s: float, now: float | None = None
    ) -> int:
        """The fewest of `workers` (taken in order: those already decoding first) over which
        the decodes, arriving at the current rate, see p99 gaps within `slo_itl_s`; where none
        do, the count with the shortest; 1 before the rate is known."""
        rate = self.rate(now)
        if rate <= 0 or not workers:
            return 1
        best, best_p99 = 1, float("inf")
        for k, p99 in self._p99_per_count(workers, rate, now):
            if p99 <= slo_itl_s:
                return k
            if p99 < best_p99:
                best, best_p99 = k, p99
        return best

    def overload(
        self, workers: Sequence[WorkerState], slo_itl_s: float, now: float | None = None
    ) -> DecodeOverload | None:
        """Whether taking one more request sets a rate the decodes cannot hold: with it counted,
        the p99 gap in steady state passes `slo_itl_s` over every count of `workers`, and all
        of them together already have as many decodes (running and to come) as they hold
        within the SLO; then what they would see at best. None while the rate is not known,
        and where none of them holds even one decode within the SLO (a lone request's gaps
        there already miss it: refusing cannot help it)."""
        rate = self.rate(now, extra=1)
        if rate <= 0 or not workers:
            return None
        best: tuple[int, float] | None = None
        for k, p99 in self._p99_per_count(workers, rate, now):
            if p99 <= slo_itl_s:
                return None
            if best is None or p99 < best[1]:
                best = (k, p99)
        assert best is not None
        # Only once the decodes are as many as the workers hold within the SLO: a burst at a
        # rate they hold on average reads as a rate past it over the window, and the batch it
        # leaves is still short of that. All of them: the decodes may spread over every one.
        # Where they hold not one (a lone request's gaps already miss it), refusing cannot help.
        load = sum(w.batch + w.local_prefills for w in workers)
        context = self.context(now)
        shares = [_node_share(w, workers) for w in workers]
        holds = [self.holds(w, slo_itl_s, context, s) for w, s in zip(workers, shares)]
        room = sum(holds)
        if load < room or room == 0:
            return None
        out_len = max(1.0, self.output_len(now))
        gaps = [(n, _gap(w, n, context, s)) for w, n, s in zip(workers, holds, shares) if n > 0]
        ends = sum(n / (out_len * g) for n, g in gaps if g > 0)
        return DecodeOverload(rate, *best, load=load, room=room, ends_per_s=ends)

    def holds(self, w: WorkerState, slo_itl_s: float, context: float, share: float = 1.0) -> int:
        """The most decodes `w` runs with its p99 gap within `slo_itl_s`, at mean context
        `context`, its steps `share` times slower than alone (0: not even one)."""
        tail = w.measured.gap_tail()

        def p99(n: int) -> float:
            return _gap(w, n, context, share) * tail

        lo, hi = 0, w.info.max_num_seqs  # p99(lo) holds (none: trivially); find the last one
        if p99(hi) <= slo_itl_s:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if p99(mid) <= slo_itl_s:
                lo = mid
            else:
                hi = mid
        return lo


def _gap(w: WorkerState, batch: int, context: float, share: float) -> float:
    """The gap a request sees on `w` decoding in a batch of `batch` at mean context `context`,
    its steps `share` times slower than alone: the step-time model's step as a gap."""
    slower = share / w.model.scale  # its predictions carry the share for what runs now
    return w.model.decode_step_s(batch, round(batch * context)) * slower * w.measured.gap_factor()


def _node_share(w: WorkerState, decoding: Sequence[WorkerState]) -> float:
    """How much slower `w`'s decode steps run with `decoding` (the workers set decoding) than
    with its peers idle: the node's decode share where another of them shares its node."""
    node = w.info.node_ip
    if node and any(o is not w and o.info.node_ip == node for o in decoding):
        return w.host.factor(PeerWork.DECODE)
    return 1.0
