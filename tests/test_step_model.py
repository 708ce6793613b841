"""The step-time and transfer models, and the gap tail a request's predicted ITL carries, with
injected measurements: no workers, no clock."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.step_stats import StepStat
from router.cost_model import DECODE, MIN_SUPPORT, PREFILL, StepTimeModel, kin_of, prefill_pairs
from router.fake_backend import FakeBackend, fake_info
from router.handoff_model import HandoffHealth
from router.interference import caused_misses
from router.membership import Membership
from router.metrics import Metrics
from router.pool_state import WorkerState
from router.spread import MISS_WIDTH, miss_chance
from router.worker_books import ItlCheck
from tests.cost_fixtures import planner, shape, trained, true_step, with_decodes
from worker_protocol.messages import WorkerLoad


def test_step_model_starts_at_the_roofline_and_learns_the_measured_steps():
    info = fake_info("d", "decode")
    fresh = StepTimeModel(info)
    c = fresh.coefficients
    assert c.per_token_s == pytest.approx(2 * info.num_params / info.rate.flops_per_s, rel=0.01)
    assert c.base_s == pytest.approx(info.weight_bytes / info.rate.bytes_per_s, rel=0.01)
    model = trained("d", "decode").model
    for n, cached in ((16, 0), (512, 0), (2000, 500)):
        want = sum(
            true_step(min(512, n - s), prefill_pairs(min(512, n - s), cached + s), 0)
            for s in range(0, n, 512)
        )
        assert model.prefill_s(n, cached) == pytest.approx(want, rel=0.05), n
    assert model.decode_step_s(16, 16 * 300) == pytest.approx(true_step(16, 0, 4800), rel=0.05)


def test_a_worker_that_has_only_prefilled_prices_its_decodes_by_its_kins_fit():
    """A worker of both kinds that has only prefilled for its peers has seen no decode step: its
    chunks' seconds hide a step's fixed cost and say nothing of the per-context one, and its own
    fit prices decodes far too short (on a CPU, 5 ms for a 42 ms step), which made it look the
    ideal place to decode. The part of a step its fit has not seen is priced by its kin's (same
    model, same kind of device, set by the membership), until it has seen enough of its own."""
    backend = FakeBackend(num_prefill=0, num_decode=0, num_both=2)
    infos = [backend.worker_info(w) for w in ("both-0", "both-1")]
    m = Membership(backend, infos, HandoffHealth(), Metrics())
    a, b = (m.state(f"both-{i}") for i in range(2))
    truth = np.array([0.020, 0.002, 2e-7, 2e-6])  # decode attention 20x the seed's per token
    rng = np.random.default_rng(3)

    def step(batch: int, ctx: int, chunk: int, slower: float = 1.0) -> StepStat:
        pairs = prefill_pairs(chunk, 0)
        t = float(truth @ np.array([1.0, batch + chunk, pairs, ctx])) * slower
        return StepStat(batch + chunk, chunk, pairs, batch, ctx, t * (1 + rng.normal(0, 0.03)))

    def load(w: WorkerState, steps: list[StepStat]) -> WorkerLoad:
        return WorkerLoad(w.worker_id, w.info.role, 0, 0, 0, 0.1, 1000, 1024, 0, steps=tuple(steps))

    prefills = [step(0, 0, int(rng.integers(64, 513))) for _ in range(150)]
    decodes = [
        step(int(n), int(n) * int(rng.integers(100, 1500)), 0) for n in rng.integers(1, 16, 200)
    ]
    m.absorb([load(a, prefills), load(b, decodes[:5])])
    assert a.model.source(DECODE) is a.model  # a kin that has seen a few decodes only: its own
    m.absorb([load(b, prefills[:20] + decodes[5:])])
    assert a.model.support[DECODE] == 0 and a.model.source(DECODE) is b.model
    assert a.model.source(PREFILL) is a.model  # its chunks are its own
    want = float(truth @ np.array([1.0, 8, 0, 8000]))
    assert a.model.decode_step_s(8, 8000) == pytest.approx(want, rel=0.1)
    # Mixed: the decodes' part by the kin's fit, the chunk's by its own.
    _, during = a.model.chunked_s(256, prefill_pairs(256, 0), 8, 8000)
    assert during == pytest.approx(
        want + 256 * truth[1] + prefill_pairs(256, 0) * truth[2], rel=0.1
    )
    a.model.kin = ()
    assert abs(a.model.decode_step_s(8, 8000) / want - 1) > 0.3  # what its own fit says

    # A worker of another model, or of a device measured more than twice as fast, is no kin.
    assert kin_of(a.info, b.info)
    assert not kin_of(a.info, replace(b.info, num_params=2 * b.info.num_params))
    fast = replace(b.info.rate, bytes_per_s=3 * b.info.rate.bytes_per_s)
    assert not kin_of(a.info, replace(b.info, rate=fast))

    # Once it has decoded enough of its own (its steps 1.5x its kin's), its own fit prices them.
    own = [step(8, 8000, 0, slower=1.5) for _ in range(int(MIN_SUPPORT) + 5)]
    m.absorb([load(a, own)])
    assert a.model.source(DECODE) is a.model
    assert a.model.decode_step_s(8, 8000) > 1.25 * want


def test_transfer_model_uses_the_measured_bandwidth():
    t = planner().transfer
    assert t.bandwidth_bytes_s == pytest.approx(2e9, rel=0.1)
    assert t.latency_s == pytest.approx(0.030, rel=0.1)


def test_the_measured_gap_tail_counts_in_the_itl_a_request_will_see():
    """An ITL SLO holds a request's p99 gap, which on a busy machine is a few typical steps: the
    decode worker's measured tail (p99 gap over the median) multiplies the predicted step."""
    pl = planner()
    d = trained("decode-0", "decode", seed=1)
    req = shape(16, slo_itl=0.06)
    calm = pl.candidates(req, [], [d])[0]
    assert calm.itl_tail == 1.0 and calm.new_miss(req) < 0.01  # a ~30 ms step, well under
    d.measured.observe_gaps([0.03] * 95 + [0.09] * 5)  # p99 gap three times the median
    d.measured.update_tail()  # (the router does at each load poll)
    tailed = pl.candidates(req, [], [d])[0]
    assert tailed.itl_tail == pytest.approx(3.0, rel=0.05)
    assert tailed.new_miss(req) > 0.99
    # The running requests' p99 counts the tail too: work that adds a step under it causes
    # nothing new, one past it does.
    with_decodes(d, 4, 200, itl_slo_s=0.06)
    assert pl.candidates(shape(16, seed=2), [], [d])[0].caused_misses < 0.1


def test_the_gap_tail_delays_a_prefills_steps_as_it_does_the_typical_step():
    """Four requests decoding with a measured tail of 1.5: their p99 gap is 0.9 of their SLO
    without new work (60 ms steps, 90 ms gaps at the p99). A prefill whose steps take 80 ms,
    under the SLO on their own, takes their p99 past it once the 30 ms the tail adds to a step
    counts: 110 ms, about three misses (4 x (0.88 - 0.09) by the miss chances at 1.1 and 0.9
    of the SLO), not none. Work that already fails them is not the new request's doing."""
    d = trained("both-0", "both", seed=1)
    d.measured.observe_gaps([0.06] * 90 + [0.09] * 10)  # p99 1.5 x the median
    d.measured.update_tail()
    assert d.measured.gap_tail() == pytest.approx(1.5, rel=0.02)
    with_decodes(d, 4, 200, itl_slo_s=0.1)
    before = 0.06
    assert caused_misses(d, 0.08, before) == pytest.approx(4 * (0.883 - 0.094), abs=0.02)
    assert caused_misses(d, 0.05, before) == pytest.approx(0.0, abs=1e-9)  # no longer than before
    # They are at 1.2 x their SLO already: while the predictions have come as close as the
    # models claim (the spread's prior), they are as good as lost.
    assert caused_misses(d, 0.5, 0.08) < 0.1


def test_running_requests_whose_kind_came_late_here_are_counted_as_late_under_new_work():
    """Four requests whose KV came from a peer decode with a measured tail of 1.5 and an ITL SLO
    of 200 ms: their p99 gap is 90 ms without new work (60 ms steps). A prefill whose steps
    take 140 ms takes it to 170 ms, under the SLO: a few hundredths of a miss each. Once
    requests of a kind have come here at twice their predicted p99 gap, the 80 ms the prefill
    adds reads 160 and their p99 gap 250 ms: the same prefill costs each of that kind a whole
    miss. Colocated requests' bias moves those that prefilled here (decoding, or to decode once
    their local prefill is done) and not those whose KV came from a peer (checked here, as
    predicted), and the other way round. The bias scales what the new work adds, not the gap
    without it: at 3x they are not lost already (the next colocation free), and one more decode
    in their batch, a step 2 ms longer, costs them next to nothing (scaling the whole gap with
    it, 92 ms read 276)."""
    d = trained("both-0", "both", seed=1)
    d.measured.observe_gaps([0.06] * 90 + [0.09] * 10)
    d.measured.update_tail()
    for i in range(4):
        d.add_decode(f"received-{i}", 200, 0.2, local=False)

    def each(p99_s: float) -> float:
        return miss_chance(p99_s, 0.2, MISS_WIDTH) - miss_chance(0.09, 0.2, MISS_WIDTH)

    light, one = each(0.17), each(0.25)
    assert 0.005 < light < 0.05 and one > 0.99
    assert caused_misses(d, 0.14, 0.06) == pytest.approx(4 * light, abs=0.01)
    for _ in range(5):
        d.measured.itl_bias[False].observe(0.05, 0.05)  # received ones: as predicted
        d.measured.itl_bias[True].observe(0.05, 0.10)  # colocated ones: 2x
    d.measured.update_tail()
    assert d.itl_checks() == [ItlCheck(0.2, 1.0)] * 4
    assert caused_misses(d, 0.14, 0.06) == pytest.approx(4 * light, abs=0.01)
    d.add_decode("colocated", 200, 0.2, local=True)
    assert caused_misses(d, 0.14, 0.06) == pytest.approx(4 * light + one, abs=0.01)
    d.add_prefill("to-decode-here", 64, prefill_pairs(64, 0), local=True, itl_slo_s=0.2)
    assert d.coming_itl_checks() == [ItlCheck(0.2, pytest.approx(2.0))]
    assert caused_misses(d, 0.14, 0.06, 0.14) == pytest.approx(4 * light + 2 * one, abs=0.02)
    for _ in range(20):
        d.measured.itl_bias[False].observe(0.05, 0.10)  # received ones: 2x too
    d.measured.update_tail()
    assert caused_misses(d, 0.14, 0.06, 0.14) == pytest.approx(6 * one, abs=0.05)
    for _ in range(20):
        d.measured.itl_bias[False].observe(0.05, 0.15)  # received ones: 3x
    d.measured.update_tail()
    assert d.measured.itl_bias_factor(local=False) == pytest.approx(3.0)
    assert caused_misses(d, 0.14, 0.06, 0.14) == pytest.approx(6 * one, abs=0.05)
    assert caused_misses(d, 0.062, 0.06, 0.062) < 0.01  # one more decode: 96 ms at most


def test_the_gaps_requests_see_now_floor_a_new_requests_predicted_step():
    """A worker whose gaps run far longer than the decode step the model predicts for its batch
    (its steps filled with prefill chunks, its own or a peer's, or a host slower than the
    model): a new request decoding there is predicted to see those, and so to miss an SLO under
    them."""
    pl = planner()
    d = trained("both-0", "both", seed=1)
    req = shape(16, slo_itl=0.24)
    assert pl.candidates(req, [], [d])[0].new_miss(req) < 0.01  # a ~30 ms step alone
    d.measured.observe_gaps([0.2] * 90 + [0.26] * 10)  # chunk steps: median 200 ms, p99 260 ms
    d.measured.update_tail()
    assert d.measured.typical_gap() == pytest.approx(0.2)
    busy = pl.candidates(req, [], [d])[0]
    assert busy.itl_p99_s == pytest.approx(0.26, rel=0.02)
    assert busy.new_miss(req) > 0.6
    # The requests decoding there see those gaps without new work: a short prefill's steps,
    # under them, cause no new misses.
    with_decodes(d, 4, 200, itl_slo_s=0.3)
    assert pl.candidates(shape(16, seed=2), [], [d])[0].caused_misses < 0.05


def test_the_tail_is_each_requests_own_once_enough_requests_ended():
    """A worker's slow moments fall on a few requests: pooled, its gaps' p99 is three times
    their median, while each request that ended saw its own p99 at 1.2 x its median. Once 8
    have ended, the tail (what a new request's p99 is predicted to be over its step) is theirs."""
    d = trained("both-0", "both", seed=1)
    d.measured.observe_gaps([0.05] * 95 + [0.15] * 5)
    d.measured.update_tail()
    assert d.measured.gap_tail() == pytest.approx(3.0, rel=0.02)  # too few requests ended: pooled
    for i in range(8):
        d.measured.observe_request([0.05] * 98 + [0.06] * 2)  # p99 1.2 x the median
        d.measured.update_tail()
        assert d.measured.gap_tail() == pytest.approx(1.2 if i == 7 else 3.0, rel=0.02), i
    d.measured.observe_request([0.05] * 5)  # under 10 gaps: says too little
    assert len(d.measured._request_tails) == 8
