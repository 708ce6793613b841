"""What predictions miss (router/ttft_bias.py Bias, the ITL checks of router/worker_books.py),
learnt from injected first tokens and gaps: no workers, no clock."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from router.cost_model import prefill_pairs
from router.fake_backend import FakeBackend
from router.fits import affine_fit
from router.handoff_model import HandoffHealth
from router.membership import Membership
from router.metrics import Metrics
from router.placement_costs import predict_colocated
from router.policy import RequestShape
from router.pool_state import WorkerState
from router.ttft_bias import Bias
from router.vocab import RoutePath
from tests.cost_fixtures import planner, shape, trained, with_decodes
from worker_protocol.messages import WorkerInfo, WorkerLoad


def test_measured_ttft_trains_the_bias_of_its_path():
    pl = planner()
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    first = pl.decide(shape(16), [p], [d]).chosen
    for _ in range(50):
        pl.bias[first.path].observe(first.raw_ttft_s, first.raw_ttft_s + 0.040)
    again = pl.decide(shape(16, seed=3), [p], [d])
    same = next(b for b in again.best if b.path is first.path)
    assert same.ttft_s - same.raw_ttft_s == pytest.approx(0.040, rel=0.01)


def test_a_path_with_too_few_first_tokens_of_its_own_takes_the_other_paths_correction():
    """Handoffs' first tokens came 2x their prediction; no colocated one was seen: a colocated
    candidate's TTFT is corrected as the handoffs' are (left bare, it would look half as long
    as it is beside them), until eight colocated first tokens give it its own."""
    pl = planner()
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    seen = [float(x) for x in np.linspace(0.01, 10.0, 8)]  # first tokens of every size
    for raw in seen:
        pl.bias[RoutePath.DISAGGREGATED].observe(raw, 2 * raw)
    borrowed = {c.path: c for c in pl.decide(shape(300, seed=3), [p], [d]).best}
    for c in borrowed.values():
        assert c.ttft_s == pytest.approx(2 * c.raw_ttft_s, rel=0.01)
    for raw in seen:
        pl.bias[RoutePath.COLOCATED].observe(raw, raw)
    own = {c.path: c for c in pl.decide(shape(300, seed=4), [p], [d]).best}
    assert own[RoutePath.COLOCATED].ttft_s == pytest.approx(own[RoutePath.COLOCATED].raw_ttft_s)
    handoff = own[RoutePath.DISAGGREGATED]
    assert handoff.ttft_s == pytest.approx(2 * handoff.raw_ttft_s, rel=0.01)


def test_the_bias_scales_an_error_that_grows_with_the_prediction_and_adds_one_that_does_not():
    """Long prompts' first tokens came at half their prediction, short ones' 40 ms late (the
    RPC hop): a mean of measured - predicted would put a short prompt's TTFT below zero; the
    fitted correction gives each its own."""
    bias = Bias()
    assert bias.apply(1.0) == 1.0  # nothing seen: as predicted
    for raw in np.linspace(0.1, 8.0, 40):
        bias.observe(float(raw), 0.040 + 0.5 * float(raw))
    assert bias.apply(0.2) == pytest.approx(0.140, rel=0.02)
    assert bias.apply(6.0) == pytest.approx(3.040, rel=0.02)
    old = 0.0  # what the mean would have made of it
    for raw in np.linspace(0.1, 8.0, 40):
        old += (0.040 + 0.5 * raw) - raw
    assert 0.2 + old / 40 < 0 < bias.apply(0.2)
    bias.observe(0.2, 2.0)  # one cold first token, 10x its prediction, moves it a little
    assert bias.apply(0.2) < 0.2
    for _ in range(64):  # all first tokens 3x later than predicted, whatever the size
        for raw in (0.5, 5.0):
            bias.observe(raw, 3 * raw)
    assert bias.apply(1.0) == pytest.approx(3.0, rel=0.02)


def _finish(d: WorkerState, p: WorkerState, req: RequestShape, chosen, gaps: list[float]) -> None:
    """Books `chosen` for `req` and ends it with `gaps` as its inter-token gaps."""
    from collections import deque
    from unittest.mock import Mock

    from router.books import RequestBooks, RequestCounts
    from router.tracker import Tracker
    from router.vocab import FinishReason, Frontend

    track = Tracker("r", 0.0, chosen.path.value, Frontend.GRPC, req.prompt_len, chosen.ttft_s)
    track.itl_s = list(gaps)
    states = {d.worker_id: d, p.worker_id: p}
    books = RequestBooks("r", track, Mock(), RequestCounts(), deque(), states, Mock())
    with books:
        books.place(req, chosen)
        books.finished(FinishReason.LENGTH, 0)


def test_a_p99_gap_predicted_before_the_workers_gaps_were_measured_teaches_no_bias():
    """The first request on the split's decode worker was predicted without its median gap or
    their tail, and came at 2.5x: that error is the missing floor and tail, which the next
    predictions hold. It teaches the worker's tail, not the bias or the spread of its kind of
    prediction; a request placed once the gaps are measured teaches both."""
    from worker_protocol.messages import WorkerRole

    pl = planner()
    p = trained("prefill-0", WorkerRole.PREFILL)
    d = trained("decode-0", WorkerRole.DECODE, seed=1)
    raw = max(c.raw_itl_p99_s for c in pl.candidates(shape(200, seed=2), [p], [d]))
    req = shape(200, seed=2, slo_ttft=10.0, slo_itl=3 * raw)

    def handoff():
        return next(c for c in pl.candidates(req, [p], [d]) if c.path is RoutePath.DISAGGREGATED)

    cold = handoff()
    assert not cold.itl_checkable
    for _ in range(6):
        _finish(d, p, req, cold, [2.5 * cold.itl_p99_s] * 50)
    d.measured.update_tail()
    assert d.measured.itl_bias[False].samples == 0 and d.measured.itl_spread.samples == 0
    assert d.measured.itl_bias_factor(local=False) == 1.0 and len(d.measured._request_tails) == 6
    d.measured.observe_gaps([cold.itl_p99_s] * 60)
    d.measured.update_tail()
    warm = handoff()
    assert warm.itl_checkable and warm.itl_floor_s > 0
    for _ in range(6):
        _finish(d, p, req, warm, [2.0 * warm.raw_itl_p99_s] * 50)
    d.measured.update_tail()
    assert d.measured.itl_bias[False].samples == 6 and d.measured.itl_spread.samples == 6
    assert d.measured.itl_bias_factor(local=False) == pytest.approx(2.0)
    assert p.queued_prefills == d.batch == 0  # the books settled


def test_the_bias_of_one_prompt_size_adds_and_stops_scaling_past_what_it_saw():
    """A path that saw short prompts only, each 40 ms late: the error adds (a 2 s prediction
    becomes 2.04 s, not 2 s times the short prompts' ratio); one that saw predictions up to 1 s
    at half their length scales them to 1 s, and adds beyond."""
    short = Bias()
    for _ in range(7):
        short.observe(0.05, 0.09)
    assert short.apply(2.0) == 2.0  # 7 first tokens: too few to say anything
    short.observe(0.05, 0.09)
    assert short.apply(0.05) == pytest.approx(0.09)
    assert short.apply(2.0) == pytest.approx(2.04)
    halved = Bias()
    for raw in np.linspace(0.2, 1.0, 20):
        halved.observe(float(raw), 0.5 * float(raw))
    assert halved.apply(0.6) == pytest.approx(0.3, rel=0.02)
    assert halved.apply(3.0) == pytest.approx(0.5 + 2.0, rel=0.02)


def test_a_bias_below_one_does_not_take_a_p99_gap_under_the_typical_gap():
    """Colocated requests on both-0 came at a third of their predicted p99 gap (the bias of
    such predictions, bounded at 1/3): the next colocated prediction is scaled down, but no
    further than its own step as a gap and the worker's median gap. A p99 under the typical
    gap is no prediction: it made colocated placements read as sure to attain."""
    a = trained("both-0", "both")
    raw = predict_colocated(shape(64), a, Bias()).raw_itl_p99_s
    for _ in range(6):
        a.measured.observe_request([raw / 5] * 100, raw, 10.0, local=True, raw_p99_s=raw)
    a.measured.update_tail()
    assert a.measured.itl_bias_factor(local=True) == pytest.approx(1 / 3)
    c = predict_colocated(shape(64), a, Bias())
    assert c.itl_bias == pytest.approx(1 / 3)
    assert c.raw_itl_p99_s * c.itl_bias < c.itl_gap_s  # scaled alone, it would pass under
    assert c.itl_floor_s == 0 and c.itl_p99_s == pytest.approx(c.itl_gap_s)
    a.measured.observe_gaps([2 * raw] * 60)  # its requests' gaps lately: twice the step
    a.measured.update_tail()
    c = predict_colocated(shape(64), a, Bias())
    assert c.itl_floor_s == pytest.approx(2 * raw) and c.itl_p99_s >= c.itl_floor_s


def test_a_kind_of_placement_not_checked_lately_takes_the_bias_of_all_the_workers_requests():
    """On the split's decode worker, the requests whose KV came from prefill-0 have come at 1.6x
    their predicted p99 gap; none prefilled there lately. Four decode there, already past an
    ITL SLO of half a step (a new prompt costs them next to nothing). Taking a colocated
    request's gaps as predicted (a bias of 1 for want of checks), the same worker's steps read
    0.51 misses of its own against 0.90 handed off, and the request was prefilled there beside
    the four. Its kind takes the worker's bias until checks of its own come: both read alike,
    and the prompt goes to the prefill worker."""
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    pl = planner()
    raw = max(c.raw_itl_p99_s for c in pl.candidates(shape(200, seed=2), [p], [d]))
    with_decodes(d, 4, 300, 0.5 * raw)
    req = shape(200, seed=2, slo_ttft=10.0, slo_itl=1.3 * raw)
    for _ in range(6):
        d.measured.observe_request(
            [1.6 * raw] * 100, raw, req.slo_itl_s, local=False, raw_p99_s=raw
        )
    d.measured.update_tail()
    assert d.measured.itl_bias[True].samples == 0
    assert (
        d.measured.itl_bias_factor(local=True)
        == d.measured.itl_bias_factor(local=False)
        == pytest.approx(1.6)
    )
    decision = pl.decide(req, [p], [d])
    chosen = decision.chosen
    assert chosen.path is RoutePath.DISAGGREGATED, decision.reason
    colocated = next(c for c in decision.best if c.path is RoutePath.COLOCATED)
    assert colocated.itl_bias == pytest.approx(1.6)
    assert colocated.new_miss(req) == pytest.approx(chosen.new_miss(req), abs=0.01)
    assert chosen.new_miss(req) > 0.8 and colocated.caused_misses < 0.1
    assert colocated.prefill_beside == 4 and chosen.prefill_beside == 0
    assert "ITL p99" in decision.reason.split("vs colocated")[1]
    # Checks of its own come: colocated requests there came as predicted. Its kind's bias is
    # its own again (the pooled one, over both kinds, moves too).
    for _ in range(6):
        d.measured.observe_request([raw] * 100, raw, req.slo_itl_s, local=True, raw_p99_s=raw)
    d.measured.update_tail()
    assert d.measured.itl_bias_factor(local=True) == pytest.approx(1.0)
    assert d.measured.itl_bias_factor(local=False) == pytest.approx(1.6)


def test_colocated_requests_that_came_far_over_their_predicted_p99_gap_move_the_next_one():
    """both-1 has a long prompt queued; on both-0, idle, a request would prefill where it
    decodes (the quickest first token), predicted at a p99 gap 1/1.3 of its ITL SLO. Where
    requests that prefilled on their decode worker have come at 1.8x their predicted p99 gap,
    while those whose KV came from a peer came as predicted, the same placement reads as a
    likely miss: the request is prefilled on both-1 and handed to both-0, a later first token
    well within its TTFT SLO. The handoff's prediction is not scaled."""
    a, b = trained("both-0", "both"), trained("both-1", "both", seed=1)
    b.add_prefill("long", 1500, prefill_pairs(1500, 0))
    pl = planner()
    probe = pl.candidates(shape(300, seed=2), [a, b], [a, b])
    raw = max(c.raw_itl_p99_s for c in probe if c.decode_worker == "both-0")
    req = shape(300, seed=2, slo_ttft=10.0, slo_itl=1.3 * raw)
    before = pl.decide(req, [a, b], [a, b]).chosen
    assert (before.path, before.decode_worker) == (RoutePath.COLOCATED, "both-0")
    assert before.itl_bias == 1.0

    for w in (a, b):
        for _ in range(6):
            w.measured.observe_request(
                [1.8 * raw] * 100, raw, req.slo_itl_s, local=True, raw_p99_s=raw
            )
            w.measured.observe_request([raw] * 100, raw, req.slo_itl_s, local=False, raw_p99_s=raw)
        w.measured.update_tail()
        assert w.measured.itl_bias_factor(local=True) == pytest.approx(1.8)
        assert w.measured.itl_bias_factor(local=False) == pytest.approx(1.0)
    after = pl.decide(req, [a, b], [a, b])
    chosen = after.chosen
    assert (chosen.path, chosen.prefill_worker) == (RoutePath.DISAGGREGATED, "both-1"), after.reason
    assert chosen.decode_worker == "both-0" and chosen.itl_bias == pytest.approx(1.0)
    assert chosen.ttft_s < req.slo_ttft_s / 2
    colocated = next(c for c in after.best if c.path is RoutePath.COLOCATED)
    assert colocated.itl_p99_s == pytest.approx(1.8 * colocated.raw_itl_p99_s)
    assert colocated.new_miss(req) > chosen.new_miss(req) + 0.3


def test_a_prediction_bias_is_the_median_ratio_of_its_recent_checks_within_bounds():
    from router.spread import BIAS_MAX_AGE_S, MAX_BIAS, PredictionBias

    b = PredictionBias()
    for r in (1.5, 2.0, 2.5, 3.0):
        b.observe(0.1, 0.1 * r, now=0.0)
    assert b.factor(now=0.0) == 1.0  # four: too few
    b.observe(0.1, 0.1 * 1.2, now=0.0)
    assert b.factor(now=0.0) == pytest.approx(2.0)  # the median of five
    assert b.factor(now=BIAS_MAX_AGE_S + 1) == 1.0  # all forgotten
    for _ in range(5):
        b.observe(0.1, 1.0, now=10.0)  # 10x: past the bound
    assert b.factor(now=10.0) == MAX_BIAS
    b.observe(0.0, 1.0)  # nothing predicted: nothing learnt
    assert b.samples == 10


def test_a_ttft_bias_fitted_over_scattered_first_tokens_is_centred_on_them():
    """First tokens 0.2 s plus the prediction late, scattered by queueing (lognormal, sigma
    0.4): least relative error alone puts the correction 1.2-1.4x short of them; centred, half
    of them come later than it and half sooner."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        raw = rng.uniform(0.2, 2.0, 64)
        measured = (0.2 + raw) * np.exp(rng.normal(0.0, 0.4, 64))
        bias = Bias()
        for x, y in zip(raw, measured, strict=True):
            bias.observe(float(x), float(y))
        corrected = np.array([bias.apply(float(x)) for x in raw])
        assert np.median(measured / corrected) == pytest.approx(1.0, abs=0.02)
        pairs = zip(raw.tolist(), measured.tolist(), strict=True)
        fixed, scale = affine_fit(pairs, (0.0, 1.0), min_slope=Bias.MIN_SCALE)
        assert np.median(measured / (fixed + scale * raw)) > 1.15  # uncentred, it runs short


def test_a_replacement_keeps_its_predecessors_bias_and_a_removed_worker_leaves_the_metric():
    """Colocated requests on decode-0 came at twice their predicted p99 gap: its replacement
    (a new incarnation) places the next one with that factor from its first decision on, before
    any poll of its own; once decode-0 leaves the pools, the metric drops its series."""

    class Replaced(FakeBackend):
        incarnation = 0

        def worker_info(self, worker_id: str) -> WorkerInfo:
            info = super().worker_info(worker_id)
            return replace(info, incarnation=self.incarnation) if worker_id == "decode-0" else info

    backend = Replaced()
    metrics = Metrics()
    m = Membership(
        backend,
        [backend.worker_info(w) for w in ("prefill-0", "decode-0")],
        HandoffHealth(),
        metrics,
    )
    old = m.state("decode-0")
    for _ in range(5):
        old.measured.itl_bias[True].observe(0.05, 0.10)
    m.absorb([WorkerLoad("decode-0", old.info.role, 0, 0, 0, 0.0, 1024, 1024, 0)])
    labels = {"kind": "colocated", "worker": "decode-0"}
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_prediction_bias_ratio", labels) == pytest.approx(2.0)
    backend.incarnation = 1
    new = m.state("decode-0")
    assert new is not old and new.info.incarnation == 1
    assert new.measured.itl_bias_factor(local=True) == pytest.approx(2.0)
    # None received: that kind takes the worker's, over both kinds, carried too.
    assert new.measured.itl_bias_factor(local=False) == pytest.approx(2.0)
    new.measured.update_tail()
    assert new.measured.itl_bias_factor(local=False) == pytest.approx(2.0)
    assert predict_colocated(shape(64), new, Bias()).itl_bias == pytest.approx(2.0)
    backend.decode_ids.remove("decode-0")
    m.absorb([])
    assert sample("pdserve_prediction_bias_ratio", labels) is None
    assert sample("pdserve_prediction_bias_ratio", {**labels, "kind": "received"}) is None
