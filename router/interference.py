"""What new work on a worker costs the requests already decoding there (or to decode there once
their local prefill is done) and beside it: the steps they see next to queued prefills, the SLO
misses a prefill or one more decode causes among them (on the worker, and on its node's other
workers, which a worker set decoding slows where they share the node), and the floor that
frequent prefills set under a decoding request's p99 gap (router/placement_costs.py builds each
placement's prediction from these)."""

from __future__ import annotations

from collections.abc import Sequence

from router.pool_state import WorkerState
from router.spread import miss_chance
from router.worker_books import ItlCheck

# A worker's prefills of the last PREFILL_WINDOW_S show how often a request decoding there will
# have one beside it; when they would slow more than BESIDE_SHARE of its gaps, its p99 gap is
# the step beside one (see beside_floor).
PREFILL_WINDOW_S = 30.0
BESIDE_SHARE = 0.01
# A running request's ITL SLO is at risk from chunks beside it when its steps beside them, times
# the worker's tail, come within this factor of it (see prefills_beside).
BESIDE_MARGIN = 2.0
# The hold of a prompt placed behind a colocated one, priced against that one's decode: none
# (its decode is taken to outlast the hold: see prefill_end_s, coming_chunk_step).
NO_HOLD = 0.0


def caused_misses(
    w: WorkerState, during_s: float, before_s: float, coming_during_s: float | None = None
) -> float:
    """The misses that new work on `w` causes among the requests decoding there that can still
    attain, and among those to decode there once their local prefill, queued there, is done:
    for each, its chance of missing its ITL SLO with the steps the new work brings, less its
    chance without them (work already there is not the new request's doing). An ITL SLO holds
    a request's p99 gap.

    For those decoding, the steps without the new work are `before_s` (beside the prefills
    queued there), with it `during_s`. For those to come, without it a plain decode step
    (`coming_step`: the prefills queued with and before theirs end before they decode), with it
    `coming_during_s`: a prefill placed after theirs runs its chunks beside their decodes, one
    more decode makes their batch larger (None: the new work does not reach them). Without the
    new work, a request's p99 gap is its typical gap (that step as a gap: times the worker's
    gaps over its steps, `gap_factor`; or the measured median gap when longer: `typical_gap`)
    times the worker's measured tail (`gap_tail`); with it, the new steps as gaps plus the time
    the tail adds to a typical gap (a busy host, other work in the step delays them as much),
    or the former if longer. Taking the new steps alone, a worker whose tail already put its
    requests near their SLO would be seen to lose nothing to one more prefill; multiplying them
    by the tail would count twice a tail that comes from prefill chunks cut to the step target.
    What the new work adds to that p99 gap is scaled by the bias of the request's kind of
    placement on `w` (how its requests prefilled there, or with their KV from a peer, came
    against their predicted p99 gap lately: itl_bias_factor; the new request's whole predicted
    p99 gap is scaled by its own); the gap without it is not. Scaling the gap without it too,
    a bias taught by earlier colocations put the requests there past their SLO without new
    work, and the next colocation beside them cost nothing (on long-prompt at 3fb8eed,
    colocations beside running requests read 0.00-0.32 misses caused, and flex colocated 14
    requests of 40 in a round); scaling the whole gap with it, work that adds nothing but a
    decode to the batch cost each request there the bias (on chat at 431f0f0, one more decode
    on the worker decoding for the split read 3.24 misses caused among the requests there, and
    flex colocated instead). The miss chances are as wide as the worker's p99 gap predictions
    have come from its requests' measured ones (`itl_spread`): a request predicted past its SLO
    may still attain, the less so the further past it new work takes it."""
    tail, g = w.measured.gap_tail(), w.measured.gap_factor()
    width = w.measured.itl_spread.width

    def lost(checks: Sequence[ItlCheck], step_s: float, new_step_s: float) -> float:
        # What its gaps take now, as measured too.
        typical = max(step_s * g, w.measured.typical_gap())
        without = typical * tail
        added = max(0.0, new_step_s * g - typical)  # the new steps as gaps, over the typical
        return sum(
            miss_chance(without + added * b, slo, width) - miss_chance(without, slo, width)
            for slo, b in checks
        )

    caused = lost(w.itl_checks(), before_s, during_s)
    coming = w.coming_itl_checks()
    if coming and coming_during_s is not None:
        caused += lost(coming, coming_step(w), coming_during_s)
    return caused


def _with_coming(w: WorkerState) -> tuple[int, int]:
    """(batch, context) on `w` once the requests to decode there after their local prefill do."""
    return w.batch + w.local_prefills, w.context + w.coming_context


def prefill_end_s(w: WorkerState, tokens: int, pairs: float, hold_s: float | None = None) -> float:
    """How long a prompt of `tokens` prefill tokens (`pairs`) placed on `w` now takes to be
    computed: the prompts queued there first, then its own. Where the worker holds prompts for
    its running decodes (hold_wait_s, with the prompt's hold `hold_s`), all wait them out
    first. A prompt queued there for a request that decodes there too (colocated) decodes from
    its first token on: the prompts after it run their chunks beside its decode, sized to the
    step target, or down to MIN_CHUNK tokens a step where the worker's smallest chunks beside
    decodes run past it. Priced as one run beside the decodes of now, prompts placed behind
    colocated ones were predicted to prefill as if alone (on bursty at 4253129, four arriving
    together and colocated on one worker were predicted at 5.2-6.2 s and came at 5.8-15.9 s).
    A colocated prompt's decode is taken to outlast the prompts after it (its length is not in
    the books), and the worker not to hold them for it: the hold counts once, for the decodes
    running now. With no colocated prompt queued, this is the whole queue's chunked_s."""
    batch, context = w.batch, w.context
    wait = w.model.hold_wait_s(batch, context, hold_s)
    total = 0.0
    if wait is not None:
        total, batch, context = wait, 0, 0
    run_tokens, run_pairs = 0, 0.0  # the prompts queued since the latest colocated one
    for q in w.queued():
        run_tokens, run_pairs = run_tokens + q.left, run_pairs + q.pairs_left
        if q.decodes_with:
            total += w.model.chunked_s(run_tokens, run_pairs, batch, context, NO_HOLD)[0]
            run_tokens, run_pairs = 0, 0.0
            batch, context = batch + 1, context + q.decodes_with
    last = w.model.chunked_s(run_tokens + tokens, run_pairs + pairs, batch, context, NO_HOLD)
    return total + last[0]


def coming_step(w: WorkerState, more: int = 0, context: int = 0) -> float:
    """The plain decode step on `w` once the requests to decode there after their local prefill
    do (with `more` requests of `context` tokens besides)."""
    batch, ctx = _with_coming(w)
    return w.model.decode_step_s(batch + more, ctx + context)


def coming_chunk_step(w: WorkerState, tokens: int, pairs: float) -> float:
    """The step the requests to decode on `w` after their local prefill see beside a prefill of
    `tokens` placed after theirs: its chunks, sized to the step target, beside their decodes.
    The worker holds a prompt only for decodes that end within its hold; their lengths are not
    in the books, and they are taken, as in prefill_end_s, to outlast it, so that the prompt is
    not held for them (short outputs are overpriced; nor is the batch taken to shrink where the
    decodes running now are waited out first). Priced with the prompt's hold against the
    decodes running now, a prompt placed behind them was taken to wait, and cost them nothing
    (on long-prompt at b2ad1fe, two prompts colocated behind one another were predicted at 88
    and 66 ms p99 gaps and came at 272 and 276 ms). 0 when none can still attain (nothing to
    price: no step model call on a decision's path)."""
    if not w.coming_itl_slos():
        return 0.0
    return w.model.chunked_s(tokens, pairs, *_with_coming(w), NO_HOLD)[1]


def shared_misses(d: WorkerState, workers: Sequence[WorkerState]) -> float:
    """The misses that setting `d` decoding causes among the requests decoding on the other
    workers of its node (`workers`: every worker the router knows, their scales current: see
    Candidates.candidates, router/candidates.py). While `d` decodes, their steps run
    HostShare.factor(DECODE) times slower than alone, against what they run now (alone, or beside
    a prefill: `shared_slowdown`; 1 where workers share little, as on separate GPUs), for as long
    as `d` decodes: all of a request's output, where a peer's short prefill slows a few steps. 0
    when `d` decodes already, or will once a local prefill there is done (its peers' steps carry
    the share then, or will whatever is placed now), or its node is unknown."""
    if d.batch or d.local_prefills or not d.info.node_ip:
        return 0.0
    total = 0.0
    for o in workers:
        if o is d or not (o.batch or o.local_prefills) or o.info.node_ip != d.info.node_ip:
            continue
        slower = o.shared_slowdown()
        if slower > 1.0:
            # What its steps take now: the predicted step, or the gaps measured there (as steps)
            # when longer.
            now = max(
                decode_step_beside(o, o.batch, o.context),
                o.measured.typical_gap() / o.measured.gap_factor(),
            )
            total += caused_misses(o, now * slower, now, coming_step(o) * slower)
    return total


def decode_step_beside(w: WorkerState, batch: int, context: int) -> float:
    """The step `batch` decodes of total `context` see on `w`, next to the prefills queued
    there."""
    if w.queued_tokens:
        return w.model.chunked_s(w.queued_tokens, w.queued_pairs, batch, context)[1]
    return w.model.decode_step_s(batch, context)


def beside_floor(w: WorkerState, batch: int, context: int, step_s: float) -> float:
    """The step `batch` decodes of total `context` see on `w` beside a prefill of the median
    size of those placed there lately, when such prefills would slow more than BESIDE_SHARE of
    a decoding request's gaps (their rate x the steps each takes x the step `step_s`: the share
    of its time spent beside one), or some are queued there now; else 0. A request's ITL SLO
    holds its p99 gap, which one slow step in a hundred sets."""
    recent = w.recent_prefills(PREFILL_WINDOW_S)
    if not recent:
        return 0.0
    tokens, pairs = sorted(recent)[len(recent) // 2]
    steps = w.model.chunk_steps(tokens, pairs, batch, context)
    rate = len(recent) / PREFILL_WINDOW_S
    if w.queued_tokens == 0 and rate * steps * step_s < BESIDE_SHARE:
        return 0.0
    return w.model.chunked_s(tokens, pairs, batch, context)[1]


def prefills_beside(w: WorkerState, during_s: float, coming_during_s: float = 0.0) -> int:
    """The decodes running on `w` whose ITL SLO is at risk (within twice the step `during_s`
    they see beside a prefill there, as gaps, times the worker's tail), and those to run there
    once their local prefill is done, likewise with the step `coming_during_s` they would see
    beside it. A loose SLO is not at risk, and a request that can no longer attain has none.
    A count for the tie-break with its own margin (BESIDE_MARGIN), not a miss chance: the bias
    of each one's kind of placement (itl_checks) weighs in the expected misses it breaks ties
    of, not here."""
    tail = BESIDE_MARGIN * w.measured.gap_tail() * w.measured.gap_factor()
    return sum(1 for slo in w.itl_slos() if slo < during_s * tail) + sum(
        1 for slo in w.coming_itl_slos() if slo < coming_during_s * tail
    )
