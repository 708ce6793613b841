"""Admission: whether the core takes a request, before any work is done for it. Refused at once
(Overloaded, with a retry hint) when the queue of requests still waiting for their first token
is full, or when the chosen path's predicted TTFT, times how late first tokens predicted near
their SLO have come against their predictions lately (the margin), misses the request's TTFT SLO
and waiting would help (the predicted queue time is what pushes it over). A request that misses
its SLO on idle workers is served anyway. And, where RouterConfig.decode_rate_admission is on,
when taking it sets a rate of requests at which the decodes' p99 gap passes its ITL SLO in
steady state over every count of the workers that may decode, and those workers already run
(or have placed) as many decodes as they hold within it (router/capacity.py): the rate taken
then settles where the decodes hold the SLO (unless they hold not even one decode within it:
refusing would not help it)."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

from router.books import RequestCounts
from router.capacity import DecodeOverload
from router.core_types import Overloaded, RouterConfig
from router.policy import Decision, RequestShape
from router.vocab import RejectReason

# The admission margin (TtftMargin): a quantile of measured / predicted TTFT over the latest
# first tokens predicted at MARGIN_NEAR of their SLO or more.
MARGIN_WINDOW, MARGIN_MIN_SAMPLES, MARGIN_QUANTILE, MARGIN_MAX = 64, 12, 0.9, 4.0
MARGIN_NEAR = 0.5


def _queue_full(
    n: int, c: RouterConfig, counts: RequestCounts, retry_s: float
) -> Overloaded | None:
    """QUEUE_FULL where the queue has no room for `n` more requests (--max-pending waiting,
    max_active in all)."""
    if counts.pending + n <= c.max_pending and counts.active + n <= c.max_active:
        return None
    choices = f": no room for {n} choices" if n > 1 else ""
    return Overloaded(
        RejectReason.QUEUE_FULL,
        f"server busy: {counts.pending} requests wait for a first token (limit "
        f"{c.max_pending}), {counts.active} are active (limit {c.max_active}){choices}",
        retry_s,
    )


def group_refusal(n: int, config: RouterConfig, counts: RequestCounts) -> Overloaded | None:
    """Why `n` requests that stand or fall together (an HTTP request's choices) are refused
    before any is admitted: the queue has no room for all of them. Each is then admitted on
    its own (refusal): one refused there ends the others, which ran for nothing."""
    return _queue_full(n, config, counts, 0.05)


class RetrySpread:
    """The retry hints of decode_rate refusals. Such a refusal ends as decodes end, one per
    slot: first the decodes placed beyond what the workers hold (`ahead`), then one each
    for the clients refused before it, so that a burst's refused clients come back about as
    fast as room frees, rather than all together (where all but one are refused again). At
    most `most_slots` slots past those ahead (the queue's length: a client retrying at once,
    its hint unheeded, moves the next one's on, within them), and MOST_S in all."""

    MOST_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._next = float("-inf")  # when the latest client told to come back is due

    def hint(self, every_s: float, most_slots: int, ahead: int = 0) -> float:
        now = self.clock()
        # The decodes ahead have ended (within half of MOST_S: the rest is left to spread in).
        start = now + min(max(0, ahead) * every_s, self.MOST_S / 2)
        last = min(start + max(1, most_slots) * every_s, now + self.MOST_S)
        self._next = min(max(self._next, start) + every_s, last)
        return self._next - now


def refusal(
    shape: RequestShape,
    decision: Decision,
    config: RouterConfig,
    counts: RequestCounts,
    margin: float,
    spread: RetrySpread | None = None,
) -> Overloaded | None:
    """Why the request is refused now, or None when it is taken (`spread`: the decode_rate
    refusals' hints, one slot apart; None: each its own slot's)."""
    c, chosen = config, decision.chosen
    full = _queue_full(1, c, counts, max(0.05, chosen.queue_s))
    if full is not None:
        return full
    if chosen.shed(shape.slo_ttft_s, margin):
        return Overloaded(
            RejectReason.SLO,
            f"predicted TTFT {chosen.ttft_s * 1000:.0f} ms (x {margin:.2f}, how late first "
            f"tokens predicted near their SLO have come lately) exceeds the TTFT SLO "
            f"{shape.slo_ttft_s * 1000:.0f} ms "
            f"({chosen.queue_s * 1000:.0f} ms of it queueing)",
            # the queue to drain before it would pass
            min(chosen.queue_s, chosen.ttft_s - shape.slo_ttft_s / margin),
        )
    over = decision.overload
    if c.decode_rate_admission and over is not None:
        workers = "worker" if over.workers == 1 else f"{over.workers} workers"
        gaps = (
            "a batch that keeps growing (decodes come faster than they end, past the "
            "--max-num-seqs a worker runs at once)"
            if math.isinf(over.p99_s)
            else f"p99 gaps of {over.p99_s * 1000:.0f} ms"
        )
        return Overloaded(
            RejectReason.DECODE_RATE,
            f"requests come at {over.rate:.2f}/s with this one: decodes on {workers} would see "
            f"{gaps} in steady state, past the ITL SLO "
            f"{shape.slo_itl_s * 1000:.0f} ms, and {over.load} decodes run or are placed "
            f"there, of the {over.room} they hold within it",
            # How often a decode ends with as many running as they hold (else the mean gap
            # between requests taken), past those told to come back before it.
            (
                _slot_s(over)
                if spread is None
                else spread.hint(_slot_s(over), c.max_pending, over.load - over.room)
            ),
        )
    return None


def _slot_s(over: DecodeOverload) -> float:
    ends = over.ends_per_s
    return 1.0 / (ends if 0 < ends < math.inf else over.rate)


class TtftMargin:
    """Admission's factor on predicted TTFT (`value`): the MARGIN_QUANTILE of measured /
    predicted over the latest MARGIN_WINDOW first tokens whose prediction came near their SLO
    (at least MARGIN_NEAR of it), so that admission judges a prediction as late as most
    predictions that could decide an SLO have lately come. Never below 1 (predictions that run
    early do not loosen admission), never above MARGIN_MAX (a few strays cannot shut it), and 1
    until MARGIN_MIN_SAMPLES such first tokens have been seen.

    On the bare prediction, a request predicted just under its SLO is admitted and misses it
    whenever its first token comes later than predicted: on a shared machine, often. Over every
    first token, the margin is set by the short predictions: on the long-prompt trace (2-core
    CPU host, 15.8 s SLO), first tokens predicted at 3-4 s on idle workers came at 6-7 s, and
    the p90 ratio was 1.6-1.7 where those predicted near the SLO came within 0.5-1.2x of it
    (p90 1.13): requests predicted at 10 s were refused that would have attained. Which first
    tokens count is chosen by their prediction alone: chosen by what was measured too, short
    predictions that ran late would count and those that ran early would not."""

    def __init__(self) -> None:
        self._ratios: deque[float] = deque(maxlen=MARGIN_WINDOW)
        self.value = 1.0

    def observe(self, predicted_s: float, measured_s: float, slo_s: float) -> float:
        """A first token with its prediction and the request's TTFT SLO; the margin now."""
        if predicted_s > 0 and measured_s > 0 and predicted_s >= MARGIN_NEAR * slo_s:
            self._ratios.append(measured_s / predicted_s)
            if len(self._ratios) >= MARGIN_MIN_SAMPLES:
                q = statistics.quantiles(self._ratios, n=100, method="inclusive")
                self.value = min(max(q[round(MARGIN_QUANTILE * 100) - 1], 1.0), MARGIN_MAX)
        return self.value
