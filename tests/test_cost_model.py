"""The cost model and the policies with injected measurements: no workers, no clock."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from engine.prefix_hash import block_hashes
from engine.step_stats import StepStat
from router.admission import refusal
from router.books import RequestCounts
from router.capacity import MIN_SPAN_S, DecodeDemand
from router.core_types import RouterConfig
from router.cost_model import (
    DECODE,
    MIN_SUPPORT,
    PREFILL,
    Bias,
    HandoffHealth,
    StepTimeModel,
    TransferTimeModel,
    affine_fit,
    kin_of,
    prefill_pairs,
)
from router.fake_backend import FakeBackend, fake_info
from router.host_share import HostShare, PeerWork
from router.interference import beside_floor, caused_misses, coming_chunk_step, prefills_beside
from router.membership import Membership
from router.metrics import Metrics
from router.policy import Planner, Policy, PolicyConfig, RequestShape, pick_decode
from router.pool_state import ItlCheck, WorkerState, peer_work
from router.predictions import (
    PathPrediction,
    choose,
    predict_colocated,
    predict_disaggregated,
    ttft_tolerance,
)
from router.spread import MISS_WIDTH, PRIOR_WIDTH, PredictionSpread, miss_chance
from router.vocab import RejectReason, RoutePath
from worker_protocol.messages import WorkerInfo, WorkerLoad

# The "true" step time of the injected workers: 20 ms + 2 ms/token + attention terms.
TRUE = np.array([0.020, 0.002, 2e-7, 1e-7])
BLOCK = 16


def true_step(tokens: int, pairs: float, ctx: int) -> float:
    return float(TRUE @ np.array([1.0, tokens, pairs, ctx]))


def trained(
    worker_id: str,
    role: str,
    seed: int = 0,
    step_target_s: float | None = None,
    prefill_hold_s: float | None = None,
) -> WorkerState:
    """A worker whose model has seen 300 steps of mixed shapes timed by TRUE (+-2% noise)."""
    info = replace(
        fake_info(worker_id, role),
        block_size=BLOCK,
        step_target_s=step_target_s,
        prefill_hold_s=prefill_hold_s,
    )
    state = WorkerState(info)
    # Its predictions have been seen to hold as well as the models claim (router/spread.py).
    state.itl_spread = PredictionSpread(prior=MISS_WIDTH)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        batch = int(rng.integers(0, 32))
        ctx = batch * int(rng.integers(16, 1024))
        chunk = int(rng.choice([0, 0, 16, 128, 512 - batch]))
        cached = int(rng.integers(0, 1024)) if chunk else 0
        pairs = prefill_pairs(chunk, cached)
        if batch + chunk == 0:
            continue
        t = true_step(batch + chunk, pairs, ctx) * (1 + rng.normal(0, 0.02))
        state.model.observe(StepStat(batch + chunk, chunk, pairs, batch, ctx, t))
    return state


def load_of(w: WorkerState, *left: tuple[str, int]) -> WorkerLoad:
    """A poll of `w` with nothing but the prompt tokens its requests still have to compute."""
    queued = sum(n for _, n in left)
    return WorkerLoad(
        w.worker_id, w.info.role, 0, 0, 0, 0.1, 1000, 1024, queued, prefills_left=left
    )


def shape(n: int, seed: int = 0, max_tokens: int = 64, slo_ttft=30.0, slo_itl=10.0):
    ids = np.random.default_rng(seed).integers(0, 500, n).tolist()
    return RequestShape(n, tuple(block_hashes(ids, BLOCK)), max_tokens, slo_ttft, slo_itl)


def planner(policy: Policy = Policy.AUTO, **kw) -> Planner:
    transfer = TransferTimeModel()
    for nbytes in (1e5, 1e6, 1e7, 5e7):  # measured: 30 ms latency, 2 GB/s
        for _ in range(5):
            transfer.observe(int(nbytes), 0.030 + nbytes / 2e9)
    pl = Planner(PolicyConfig(policy=policy, **kw), transfer)
    pl.ttft_spread = PredictionSpread(prior=MISS_WIDTH)  # as the workers' (see trained)
    return pl


def with_decodes(
    state: WorkerState, n: int, ctx: int, itl_slo_s: float, left: int = 0
) -> WorkerState:
    for i in range(n):
        state.add_decode(f"running-{i}", ctx, itl_slo_s, local=False, left=left)
    return state


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


def test_choice_moves_to_disaggregated_as_prompts_grow_next_to_running_decodes():
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = with_decodes(trained("decode-0", "decode", seed=1), 8, 400, itl_slo_s=0.2)
    paths = {}
    for n in (8, 64, 256, 1024, 4000):
        decision = pl.decide(shape(n, seed=n), [p], [d])
        paths[n] = decision.chosen.path
        assert decision.reason and decision.reason_code
    assert paths[8] is RoutePath.COLOCATED
    assert paths[4000] is RoutePath.DISAGGREGATED
    flips = [n for n, a, b in zip(paths, paths.values(), list(paths.values())[1:]) if a is not b]
    assert len(flips) == 1, paths  # one switch point as prompts grow


def test_short_prompts_stay_colocated_and_say_why():
    pl = planner()
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    decision = pl.decide(shape(16), [p], [d])
    assert decision.chosen.path is RoutePath.COLOCATED
    assert decision.reason.startswith("colocated: expected SLO misses 0.00")
    assert "predicted TTFT" in decision.reason and "ITL p99" in decision.reason
    best = {b.path: b for b in decision.best}
    assert best[RoutePath.COLOCATED].ttft_s < best[RoutePath.DISAGGREGATED].ttft_s


def _disaggregated_wins(pl, p, d):
    decision = pl.decide(shape(2000, seed=5), [p], [d])
    assert decision.chosen.path is RoutePath.DISAGGREGATED, decision.reason
    return decision


def test_a_saturated_prefill_pool_moves_the_choice_to_colocated():
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = with_decodes(trained("decode-0", "decode", seed=1), 32, 300, itl_slo_s=10.0)
    _disaggregated_wins(pl, p, d)
    for i in range(12):
        p.add_prefill(f"queued-{i}", 2000, prefill_pairs(2000, 0))
    decision = pl.decide(shape(2000, seed=5), [p], [d])
    assert decision.chosen.path is RoutePath.COLOCATED, decision.reason
    best = {b.path: b for b in decision.best}
    assert best[RoutePath.DISAGGREGATED].queue_s > 10 * best[RoutePath.COLOCATED].queue_s
    assert "vs" in decision.reason and decision.reason_code.startswith("cost")


def test_a_drop_in_measured_bandwidth_moves_the_choice_to_colocated():
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = with_decodes(trained("decode-0", "decode", seed=1), 32, 300, itl_slo_s=10.0)
    before = _disaggregated_wins(pl, p, d)
    for _ in range(15):  # the link slows to 2 MB/s
        for nbytes in (1e5, 1e6, 4e6):
            pl.transfer.observe(int(nbytes), 0.030 + nbytes / 2e6)
    assert pl.transfer.bandwidth_bytes_s < 4e6
    after = pl.decide(shape(2000, seed=5), [p], [d])
    assert after.chosen.path is RoutePath.COLOCATED, after.reason
    disagg = {b.path: b for b in after.best}[RoutePath.DISAGGREGATED]
    # The 32 running decodes' ITL SLO (10 s) is far from any step a prefill beside them makes:
    # none is at risk, and the quicker first token decides.
    assert after.chosen.prefill_beside == 0 and disagg.prefill_beside == 0
    assert after.reason_code == "cost_ttft"
    assert disagg.transfer_s > 10 * before.chosen.transfer_s


def test_misses_caused_among_running_requests_count_against_a_faster_first_token():
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = with_decodes(trained("decode-0", "decode", seed=1), 4, 200, itl_slo_s=0.15)
    # A long prompt next to a loose TTFT SLO: colocated has the lower TTFT (no transfer), but
    # its 512-token chunks would stretch the 4 running requests' ITL to over a second.
    decision = pl.decide(shape(1500, seed=9), [p], [d])
    assert decision.chosen.path is RoutePath.DISAGGREGATED
    assert decision.reason_code == "cost_misses"
    colo = {b.path: b for b in decision.best}[RoutePath.COLOCATED]
    assert colo.running_itl_s > 0.15 and colo.caused_misses == pytest.approx(4.0, abs=0.01)
    assert colo.ttft_s < decision.chosen.ttft_s
    assert "running requests' 4.00" in decision.reason
    # With no prefill worker there is no other choice: colocated, its misses said.
    alone = pl.decide(shape(1500, seed=9), [], [d])
    assert alone.chosen.path is RoutePath.COLOCATED
    assert "expected SLO misses 4.00" in alone.reason


def test_violations_are_counted_not_vetoed():
    """Pushing one running request past its ITL SLO is worth it when the other choice makes the
    new request miss its TTFT (a tie in misses; the new request's SLO decides), and is not when
    it pushes many: no single guard decides alone."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    for i in range(6):  # the prefill worker is saturated: a handoff would miss its TTFT SLO
        p.add_prefill(f"queued-{i}", 2000, prefill_pairs(2000, 0))
    req = shape(1500, seed=9, slo_ttft=6.0)
    one = with_decodes(trained("decode-0", "decode", seed=1), 1, 200, itl_slo_s=0.15)
    decision = pl.decide(req, [p], [one])
    best = {b.path: b for b in decision.best}
    colo, dis = best[RoutePath.COLOCATED], best[RoutePath.DISAGGREGATED]
    assert colo.overshoot_s > 0.1 * 0.15  # the guard of old would have vetoed it
    assert colo.caused_misses == pytest.approx(1.0, abs=0.01) and colo.new_miss(req) < 0.01
    assert dis.new_miss(req) > 0.99 and dis.caused_misses < 0.01
    assert decision.chosen.path is RoutePath.COLOCATED, decision.reason
    many = with_decodes(trained("decode-0", "decode", seed=1), 8, 200, itl_slo_s=0.15)
    assert pl.decide(req, [p], [many]).chosen.path is RoutePath.DISAGGREGATED


def test_threshold_policy_is_dynamos_rule():
    pl = planner(Policy.THRESHOLD, threshold_tokens=100, threshold_queue=2)
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    assert pl.decide(shape(64), [p], [d]).chosen.path is RoutePath.COLOCATED
    long = pl.decide(shape(300), [p], [d])
    assert long.chosen.path is RoutePath.DISAGGREGATED and long.reason_code == "threshold_remote"
    p.add_prefill("a", 10, 10.0)
    p.add_prefill("b", 10, 10.0)
    busy = pl.decide(shape(300, seed=1), [p], [d])
    assert busy.chosen.path is RoutePath.COLOCATED and "prefill queue" in busy.reason
    # Tokens the decode worker already caches do not count toward T.
    idle_p = trained("prefill-1", "prefill")
    d.prefix.insert(shape(300, seed=2).hashes)
    cached = pl.decide(shape(300, seed=2), [idle_p], [d])
    assert cached.chosen.path is RoutePath.COLOCATED, cached.reason
    assert "12 uncached tokens" in cached.reason


def test_fixed_policies_and_the_client_override():
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    assert planner(Policy.COLOCATED).decide(shape(4000), [p], [d]).chosen.path is (
        RoutePath.COLOCATED
    )
    assert planner(Policy.DISAGGREGATED).decide(shape(8), [p], [d]).chosen.path is (
        RoutePath.DISAGGREGATED
    )
    over = planner(Policy.COLOCATED).decide(shape(8), [p], [d], RoutePath.DISAGGREGATED)
    assert over.chosen.path is RoutePath.DISAGGREGATED and over.reason_code == "override"
    none = planner(Policy.DISAGGREGATED).decide(shape(8), [], [d])
    assert none.chosen.path is RoutePath.COLOCATED and none.reason_code == "no_prefill_workers"


def test_decode_worker_by_load_with_prefix_affinity_when_loads_are_close():
    a, b = trained("decode-0", "decode"), trained("decode-1", "decode", seed=1)
    req = shape(320, seed=4)
    b.prefix.insert(req.hashes)
    with_decodes(b, 2, 100, 1.0)  # b is a little busier but holds the prefix
    assert pick_decode(req, [a, b], margin=0.1) is b
    with_decodes(b, 60, 400, 1.0)  # now far busier: load wins over affinity
    assert pick_decode(req, [a, b], margin=0.1) is a
    # The cost model sees the cached prefix too: fewer uncached tokens on b.
    pl = planner()
    c = pl.candidates(req, [], [a, b])
    assert {x.decode_worker: x.uncached_tokens for x in c} == {"decode-0": 320, "decode-1": 16}


def test_prefill_worker_by_predicted_queue_time():
    pl = planner(Policy.DISAGGREGATED)
    p0, p1 = trained("prefill-0", "prefill"), trained("prefill-1", "prefill", seed=2)
    d = trained("decode-0", "decode", seed=1)
    p0.add_prefill("x", 3000, prefill_pairs(3000, 0))
    assert pl.decide(shape(100), [p0, p1], [d]).chosen.prefill_worker == "prefill-1"


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


def test_a_batch_already_at_its_itl_slo_still_steers_long_prompts_away():
    """One more sequence in a batch that runs at its SLO is no push; a prefill chunk is."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = trained("decode-0", "decode", seed=1)
    step = d.model.decode_step_s(20, 20 * 300)
    with_decodes(d, 20, 300, itl_slo_s=step * 0.99)  # already just past its SLO
    decision = pl.decide(shape(1500, seed=21), [p], [d])
    assert decision.chosen.path is RoutePath.DISAGGREGATED, decision.reason
    best = {b.path: b for b in decision.best}
    assert best[RoutePath.COLOCATED].overshoot_s > 10 * best[RoutePath.DISAGGREGATED].overshoot_s


def test_a_step_target_makes_colocated_safe_for_running_requests_at_a_longer_ttft():
    pl = planner()
    p = trained("prefill-0", "prefill")
    for _ in range(3):  # the prefill worker is busy: three long prompts queued
        p.add_prefill(f"queued-{len(p._prefills)}", 1500, prefill_pairs(1500, 0))
    plain = with_decodes(trained("decode-0", "decode", seed=1), 4, 200, itl_slo_s=0.15)
    sized = with_decodes(
        trained("decode-0", "decode", seed=1, step_target_s=0.12), 4, 200, itl_slo_s=0.15
    )
    req = shape(800, seed=4, slo_ttft=20.0)
    before = pl.decide(req, [p], [plain])
    after = pl.decide(req, [p], [sized])
    colo_before = {b.path: b for b in before.best}[RoutePath.COLOCATED]
    colo_after = {b.path: b for b in after.best}[RoutePath.COLOCATED]
    # 512-token chunks next to the decodes: over a second a step; sized: about the target.
    assert colo_before.running_itl_s > 1.0 and colo_before.caused_misses > 3.9
    assert colo_after.running_itl_s == pytest.approx(0.12, rel=0.1)
    assert colo_after.caused_misses < 0.1
    assert colo_after.ttft_s > colo_before.ttft_s  # smaller chunks: more steps
    # Behind the queued prompts the prefill worker is slower still: auto prefills locally now.
    assert before.chosen.path is RoutePath.DISAGGREGATED
    assert after.chosen.path is RoutePath.COLOCATED


def test_a_step_target_the_decodes_alone_nearly_fill_is_not_trusted():
    # 40 decodes take about 104 ms a step; even the smallest chunk at a 1500-token prompt's end
    # takes the step past a 120 ms target: the guard sees the step the decodes will get.
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = with_decodes(
        trained("decode-0", "decode", seed=1, step_target_s=0.12), 40, 1000, itl_slo_s=0.12
    )
    decision = pl.decide(shape(1500, seed=5), [p], [d])
    colo = {b.path: b for b in decision.best}[RoutePath.COLOCATED]
    assert colo.running_itl_s > 0.13 and colo.caused_misses > 30  # of 40
    assert decision.chosen.path is RoutePath.DISAGGREGATED


def _holding(left: int, floor_s: float = 0.15) -> WorkerState:
    """A decode worker with a 120 ms step target that holds prompts up to 5 s for its decodes
    (prefill_hold_s), its smallest chunks beside decodes polled at `floor_s` a step, and 40
    requests decoding at 1000 tokens each with `left` tokens still to come."""
    d = trained("decode-0", "decode", seed=1, step_target_s=0.12, prefill_hold_s=5.0)
    d.absorb(WorkerLoad("decode-0", d.info.role, 40, 0, 0, 0.1, 1000, 1024, 0,
                        chunk_floor_s=floor_s))  # fmt: skip
    return with_decodes(d, 40, 1000, itl_slo_s=0.12, left=left)


def test_a_worker_that_holds_prompts_for_short_decodes_prices_a_wait_not_their_misses():
    """Where the smallest chunk beside its decodes takes a step past the target and they end
    within the hold, a prompt placed there waits for them and runs alone: its TTFT carries the
    wait, and the decodes keep their own steps (no misses caused). Where they outlast the hold,
    or a chunk keeps to the target, the prompt is priced in chunks beside them, as before."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    req = shape(1500, seed=5)
    held = _holding(left=20)
    wait = held.model.hold_wait_s(held.batch, held.context)
    step = held.model.decode_step_s(40, 40 * 1000)
    assert wait == pytest.approx(20 * step) and wait < 5.0
    colo = {b.path: b for b in pl.decide(req, [p], [held]).best}[RoutePath.COLOCATED]
    alone = held.model.chunked_s(1500, prefill_pairs(1500, 0), 0, 0)[0]
    assert colo.caused_misses < 0.01 and colo.running_itl_s == pytest.approx(step)
    assert colo.raw_ttft_s == pytest.approx(wait + alone)
    for d in (_holding(left=100), _holding(left=20, floor_s=0.11)):  # 10 s of decodes; fits
        assert d.model.hold_wait_s(d.batch, d.context) is None
        colo = {b.path: b for b in pl.decide(req, [p], [d]).best}[RoutePath.COLOCATED]
        assert colo.running_itl_s > 0.13 and colo.caused_misses > 30
    # Each token that comes shortens the wait; a decode of unknown length prices none.
    held.grow("running-0", 10)
    assert held.model.decode_left == 20
    for i in range(1, 40):
        held.grow(f"running-{i}", 10)
    assert held.model.decode_left == 10
    held.add_decode("unknown", 100, 0.12, local=False)
    assert held.model.hold_wait_s(held.batch, held.context) is None
    held.finish("unknown")
    assert held.model.hold_wait_s(held.batch, held.context) is not None


def test_the_hold_a_waiting_prompt_used_is_not_priced_again():
    """A prompt in line there that has waited most of its hold (polled) leaves the rest to a
    prompt placed now: decodes that end within the whole hold but not within what is left are
    priced with chunks beside them, at the smallest chunks' step measured there."""
    d = _holding(left=20)  # 20 decode steps: well within 5 s
    wait = d.model.hold_wait_s(d.batch, d.context)
    assert wait is not None and wait < 4.0
    d.absorb(WorkerLoad("decode-0", d.info.role, 40, 1, 0, 0.1, 1000, 1024, 900,
                        chunk_floor_s=0.15, hold_left_s=wait / 2))  # fmt: skip
    assert d.model.hold_wait_s(d.batch, d.context) is None
    _, during = d.model.chunked_s(1500, prefill_pairs(1500, 0), d.batch, d.context)
    assert during >= 0.15


def test_a_prompts_own_hold_bounds_the_wait_priced_for_it():
    """A request that brings its own hold (RequestShape.prefill_hold_s, from its TTFT SLO) is
    priced by it rather than by the worker's: decodes that outlast it are priced with its chunks
    beside them, ones within it as a wait even past the worker's own hold; 0 prices no wait."""
    d = _holding(left=20)  # the worker's own hold: 5 s
    wait = d.model.hold_wait_s(d.batch, d.context)
    assert wait is not None
    assert d.model.hold_wait_s(d.batch, d.context, wait / 2) is None
    assert d.model.hold_wait_s(d.batch, d.context, 0.0) is None
    assert d.model.hold_wait_s(d.batch, d.context, wait * 1.01) == pytest.approx(wait)
    long = _holding(left=100)  # 100 decode steps: past the worker's 5 s
    assert long.model.hold_wait_s(long.batch, long.context) is None
    assert long.model.hold_wait_s(long.batch, long.context, 60.0) == pytest.approx(5 * wait)
    # The prompts in line there bound it too (polled: the least hold left among them); with no
    # prompt placed now, their holds are what counts, not the worker's own.
    line = _holding(left=100)
    line.absorb(WorkerLoad("decode-0", line.info.role, 40, 1, 0, 0.1, 1000, 1024, 900,
                           chunk_floor_s=0.15, hold_left_s=60.0))  # fmt: skip
    assert line.model.hold_wait_s(line.batch, line.context) == pytest.approx(5 * wait)
    line.absorb(WorkerLoad("decode-0", line.info.role, 40, 1, 0, 0.1, 1000, 1024, 900,
                           chunk_floor_s=0.15, hold_left_s=wait))  # fmt: skip
    assert line.model.hold_wait_s(line.batch, line.context, 60.0) is None
    pl, p = planner(), trained("prefill-0", "prefill")
    for hold, waits in ((None, True), (wait / 2, False), (0.0, False)):
        req = replace(shape(1500, seed=5), prefill_hold_s=hold)
        colo = {b.path: b for b in pl.decide(req, [p], [d]).best}[RoutePath.COLOCATED]
        assert (colo.caused_misses < 0.01) is waits and (colo.caused_misses > 30) is not waits


def test_a_chunk_beside_decodes_is_priced_no_quicker_than_the_smallest_chunks_measured():
    """The fit may price a 16-token chunk beside decodes well under what such steps took there
    (on a CPU host: 133 ms at the median, past 160 ms often): the decodes beside a chunk see
    at least the slowest of the latest such steps the worker measured."""
    d = trained("decode-0", "decode", seed=1, step_target_s=0.12)
    with_decodes(d, 4, 1000, itl_slo_s=0.15)
    pairs = prefill_pairs(1500, 0)
    fitted = d.model.chunked_s(1500, pairs, d.batch, d.context)[1]
    alone = d.model.chunked_s(1500, pairs, 0, 0)
    slow = fitted * 1.5
    d.absorb(WorkerLoad("decode-0", d.info.role, 4, 0, 0, 0.1, 1000, 1024, 0,
                        chunk_floor_s=slow))  # fmt: skip
    assert d.model.chunked_s(1500, pairs, d.batch, d.context)[1] == pytest.approx(slow)
    assert d.model.chunked_s(1500, pairs, 0, 0) == alone  # no decodes beside: as it was
    d.model.chunk_floor_s = fitted / 2  # a floor under the fitted step changes nothing
    assert d.model.chunked_s(1500, pairs, d.batch, d.context)[1] == pytest.approx(fitted)
    d.model.chunk_floor_s, d.model.step_target_s = None, None  # no target: whole-budget chunks
    plain = d.model.chunked_s(1500, pairs, d.batch, d.context)
    d.model.chunk_floor_s = 10.0 * plain[1]
    assert d.model.chunked_s(1500, pairs, d.batch, d.context) == plain


def test_a_long_handoff_to_a_worker_holding_prompts_ends_their_wait_in_its_prediction():
    """A request handed off to a worker that holds prompts is one more decode they would wait
    for: a short one keeps them waiting (the decodes there see their own steps), a long one
    lets them run in chunks beside it and the others."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = _holding(left=20)
    d.add_prefill("queued", 800, prefill_pairs(800, 0), local=True, itl_slo_s=0.12)
    step = d.model.decode_step_s(41, 40 * 1000 + 1500)

    def handoff(max_tokens):
        cands = pl.candidates(shape(1500, seed=5, max_tokens=max_tokens), [p], [d])
        return next(c for c in cands if c.path is RoutePath.DISAGGREGATED)

    assert handoff(20).running_itl_s == pytest.approx(step)
    assert handoff(400).running_itl_s > 0.13
    assert d.model.decode_left == 20  # as it was


def test_auto_stops_choosing_a_pair_whose_handoffs_keep_failing_and_tries_it_again_later():
    p, d = trained("prefill-0", "prefill", seed=3), trained("decode-0", "decode", seed=4)
    with_decodes(d, 8, 512, 1.0)
    pl = planner()
    req = shape(2000, max_tokens=64)
    assert pl.decide(req, [p], [d]).chosen.path is RoutePath.DISAGGREGATED
    for _ in range(2):  # two handoffs fell back, each after wasting 3 s
        pl.health.observe("prefill-0", "decode-0", ok=False, wasted_s=3.0)
    decision = pl.decide(req, [p], [d])
    assert decision.chosen.path is RoutePath.COLOCATED
    assert decision.reason_code == "handoff_failing" and "keep falling back" in decision.reason
    dis = next(b for b in decision.best if b.path is RoutePath.DISAGGREGATED)
    assert dis.failure_rate == pytest.approx(0.75, abs=0.01)
    # Its expected TTFT counts the waste and the local prefill that follows a fallback.
    assert dis.ttft_s > dis.raw_ttft_s + 0.75 * 3.0
    # Two half-lives later the failures have faded: auto tries the pair again.
    pl.health = type(pl.health)(half_life_s=60.0)
    past = time.monotonic() - 120.0
    for _ in range(2):
        pl.health.observe("prefill-0", "decode-0", ok=False, wasted_s=3.0, now=past)
    assert pl.health.failure_rate("prefill-0", "decode-0") < 0.2
    assert pl.decide(req, [p], [d]).chosen.path is RoutePath.DISAGGREGATED


def test_a_failing_pair_is_passed_over_for_a_healthy_one():
    p0, p1 = trained("prefill-0", "prefill", seed=5), trained("prefill-1", "prefill", seed=6)
    d = with_decodes(trained("decode-0", "decode", seed=7), 8, 512, 1.0)
    pl = planner()
    req = shape(2000, max_tokens=64)
    for _ in range(3):
        pl.health.observe("prefill-0", "decode-0", ok=False)
    for policy in (Policy.AUTO, Policy.DISAGGREGATED, Policy.THRESHOLD):
        pl.config = PolicyConfig(policy=policy, threshold_tokens=100)
        chosen = pl.decide(req, [p0, p1], [d]).chosen
        assert (chosen.path, chosen.prefill_worker) == (RoutePath.DISAGGREGATED, "prefill-1")


def test_a_worker_of_both_kinds_is_never_planned_to_hand_its_kv_to_itself():
    """Workers that both prefill and decode are in the prefill and the decode list alike: a
    handoff is planned between two different workers only (P = D is the colocated path)."""
    a, b = trained("both-0", "both"), trained("both-1", "both", seed=1)
    for policy in (Policy.AUTO, Policy.DISAGGREGATED, Policy.THRESHOLD):
        pl = planner(policy, threshold_tokens=10)
        cands = pl.candidates(shape(500), [a, b], [a, b])
        handoffs = {
            (c.prefill_worker, c.decode_worker)
            for c in cands
            if c.path is (RoutePath.DISAGGREGATED)
        }
        assert handoffs == {("both-0", "both-1"), ("both-1", "both-0")}
        chosen = pl.decide(shape(500), [a, b], [a, b]).chosen
        assert chosen.path is RoutePath.COLOCATED or chosen.prefill_worker != chosen.decode_worker
        # One worker alone: only colocated, whatever is asked.
        alone = pl.decide(shape(500), [a], [a], RoutePath.DISAGGREGATED)
        assert alone.chosen.path is RoutePath.COLOCATED
        assert alone.reason_code == "no_prefill_workers"
    dis = planner(Policy.DISAGGREGATED).decide(shape(500), [a, b], [a, b]).chosen
    assert dis.path is RoutePath.DISAGGREGATED and dis.prefill_worker != dis.decode_worker


def test_the_measured_gap_tail_counts_in_the_itl_a_request_will_see():
    """An ITL SLO holds a request's p99 gap, which on a busy machine is a few typical steps: the
    decode worker's measured tail (p99 gap over the median) multiplies the predicted step."""
    pl = planner()
    d = trained("decode-0", "decode", seed=1)
    req = shape(16, slo_itl=0.06)
    calm = pl.candidates(req, [], [d])[0]
    assert calm.itl_tail == 1.0 and calm.new_miss(req) < 0.01  # a ~30 ms step, well under
    d.observe_gaps([0.03] * 95 + [0.09] * 5)  # p99 gap three times the median
    d.update_tail()  # (the router does at each load poll)
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
    d.observe_gaps([0.06] * 90 + [0.09] * 10)  # p99 1.5 x the median
    d.update_tail()
    assert d.gap_tail() == pytest.approx(1.5, rel=0.02)
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
    d.observe_gaps([0.06] * 90 + [0.09] * 10)
    d.update_tail()
    for i in range(4):
        d.add_decode(f"received-{i}", 200, 0.2, local=False)

    def each(p99_s: float) -> float:
        return miss_chance(p99_s, 0.2, MISS_WIDTH) - miss_chance(0.09, 0.2, MISS_WIDTH)

    light, one = each(0.17), each(0.25)
    assert 0.005 < light < 0.05 and one > 0.99
    assert caused_misses(d, 0.14, 0.06) == pytest.approx(4 * light, abs=0.01)
    for _ in range(5):
        d.itl_bias[False].observe(0.05, 0.05)  # received ones: as predicted
        d.itl_bias[True].observe(0.05, 0.10)  # colocated ones: 2x
    d.update_tail()
    assert d.itl_checks() == [ItlCheck(0.2, 1.0)] * 4
    assert caused_misses(d, 0.14, 0.06) == pytest.approx(4 * light, abs=0.01)
    d.add_decode("colocated", 200, 0.2, local=True)
    assert caused_misses(d, 0.14, 0.06) == pytest.approx(4 * light + one, abs=0.01)
    d.add_prefill("to-decode-here", 64, prefill_pairs(64, 0), local=True, itl_slo_s=0.2)
    assert d.coming_itl_checks() == [ItlCheck(0.2, pytest.approx(2.0))]
    assert caused_misses(d, 0.14, 0.06, 0.14) == pytest.approx(4 * light + 2 * one, abs=0.02)
    for _ in range(20):
        d.itl_bias[False].observe(0.05, 0.10)  # received ones: 2x too
    d.update_tail()
    assert caused_misses(d, 0.14, 0.06, 0.14) == pytest.approx(6 * one, abs=0.05)
    for _ in range(20):
        d.itl_bias[False].observe(0.05, 0.15)  # received ones: 3x
    d.update_tail()
    assert d.itl_bias_factor(local=False) == pytest.approx(3.0)
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
    d.observe_gaps([0.2] * 90 + [0.26] * 10)  # chunk steps: median 200 ms, p99 260 ms
    d.update_tail()
    assert d.typical_gap() == pytest.approx(0.2)
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
    d.observe_gaps([0.05] * 95 + [0.15] * 5)
    d.update_tail()
    assert d.gap_tail() == pytest.approx(3.0, rel=0.02)  # too few requests ended: pooled
    for i in range(8):
        d.observe_request([0.05] * 98 + [0.06] * 2)  # p99 1.2 x the median
        d.update_tail()
        assert d.gap_tail() == pytest.approx(1.2 if i == 7 else 3.0, rel=0.02), i
    d.observe_request([0.05] * 5)  # under 10 gaps: says too little
    assert len(d._request_tails) == 8


def test_a_prompt_of_several_chunks_goes_where_no_decodes_run_when_its_first_token_can_wait():
    """Expected misses tied (none predicted either way), a prompt that takes several chunks next
    to running decodes whose ITL SLO is within twice the steps it makes is prefilled where none
    run, though its first token comes later there, as long as it comes within a quarter of its
    TTFT SLO (and twice the quicker one): its chunks would slow many of their steps, and such
    steps pass SLOs more often than the model predicts. A short prompt's step beside them stays
    well under their SLO (none at risk) and it stays on the quicker path; so does a long one
    beside decodes whose SLO is loose."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    p.add_prefill("queued", 1000, prefill_pairs(1000, 0))  # the prefill worker is the slower
    loose_d = with_decodes(trained("decode-0", "decode", seed=1), 8, 400, itl_slo_s=10.0)
    long_req = shape(1500, seed=3, slo_ttft=30.0)
    loose_decision = pl.decide(long_req, [p], [loose_d])
    assert loose_decision.chosen.path is RoutePath.COLOCATED, loose_decision.reason
    step_beside = loose_decision.chosen.running_itl_s
    # SLOs at 1/0.6 of the step beside the prefill: at risk, no miss predicted.
    d = with_decodes(trained("decode-0", "decode", seed=1), 8, 400, itl_slo_s=step_beside / 0.6)
    decision = pl.decide(long_req, [p], [d])
    best = {b.path: b for b in decision.best}
    colo, dis = best[RoutePath.COLOCATED], best[RoutePath.DISAGGREGATED]
    assert colo.ttft_s < dis.ttft_s and colo.expected_misses(long_req) < 0.1
    assert (colo.prefill_beside, dis.prefill_beside) == (8, 0)
    assert decision.chosen.path is RoutePath.DISAGGREGATED, decision.reason
    assert decision.reason_code == "cost_prefill_beside"
    assert "prefilled beside 0 running decodes, not 8" in decision.reason
    # A tighter TTFT SLO: the handoff's first token comes more than a quarter of it later, and
    # the quicker one wins.
    tight = replace(long_req, slo_ttft_s=1.2 * dis.ttft_s)
    assert dis.ttft_s - colo.ttft_s > ttft_tolerance(colo.ttft_s, tight)
    assert pl.decide(tight, [p], [d]).chosen.path is RoutePath.COLOCATED
    # No TTFT SLO at all: a first token more than twice as late is not as quick.
    slow = replace(colo, ttft_s=2.5 * colo.ttft_s, prefill_beside=0)
    loose = replace(long_req, slo_ttft_s=float("inf"))
    assert choose([colo, slow], loose) is colo
    assert choose([colo, replace(slow, ttft_s=1.9 * colo.ttft_s)], loose).prefill_beside == 0
    short = pl.decide(shape(64, seed=4, slo_ttft=20.0), [p], [d])
    assert short.chosen.path is RoutePath.COLOCATED
    assert short.chosen.prefill_beside == 0  # its step beside them: far under their SLO


def test_workers_of_both_kinds_gather_decodes_and_keep_a_free_one_prefilling():
    """Two workers of both kinds, one decoding: a long prompt prefills on the free one and
    decodes where decodes run, a disaggregated split the rule reaches by itself; once the
    decoding worker's steps would make the new request miss its ITL SLO, it decodes on the
    free one."""
    pl = planner()
    a = with_decodes(trained("both-0", "both", seed=1), 4, 400, itl_slo_s=0.2)
    b = trained("both-1", "both", seed=2)
    req = shape(1500, seed=3, slo_ttft=20.0, slo_itl=0.2)
    chosen = pl.decide(req, [a, b], [a, b]).chosen
    assert (chosen.path, chosen.prefill_worker, chosen.decode_worker) == (
        RoutePath.DISAGGREGATED,
        "both-1",
        "both-0",
    ), chosen
    colocated_b = next(
        c
        for c in pl.candidates(req, [a, b], [a, b])
        if c.path is RoutePath.COLOCATED and c.decode_worker == "both-1"
    )
    assert colocated_b.decode_lean == (True, True, 0) and chosen.decode_lean == (True, False, -4)
    assert colocated_b.ttft_s < chosen.ttft_s  # the quicker first token, not taken
    decision = pl.decide(req, [a, b], [a, b])
    assert decision.reason_code == "cost_gather_decodes", decision.reason
    assert "decodes gather on both-0 (4 decodes running or to come there" in decision.reason
    # both-0's gaps now near the SLO: a new request decoding there would miss.
    a.observe_gaps([0.19] * 95 + [0.25] * 5)
    a.update_tail()
    crowded = pl.decide(req, [a, b], [a, b]).chosen
    assert crowded.decode_worker == "both-1", crowded


def test_a_request_does_not_decode_beside_the_prefills_a_worker_keeps_running_for_its_peers():
    """both-1 prefills for both-0 (four 1500-token prompts in the last half minute) and decodes
    two requests of its own, too few to have measured a tail: a request decoding there would see
    the steps beside those prefills as its p99 gap. The rule predicts that step, past the new
    request's ITL SLO, and decodes it on both-0, which runs decodes only, though its batch puts
    the request near its SLO there; a both-1 that has not been prefilling would have taken it
    (no miss expected there)."""
    pl = planner()

    def worker_pair(prefilling: bool) -> tuple[WorkerState, WorkerState]:
        a = with_decodes(trained("both-0", "both", seed=1), 6, 400, itl_slo_s=10.0)
        b = with_decodes(trained("both-1", "both", seed=2), 2, 400, itl_slo_s=10.0)
        if prefilling:
            for i in range(4):
                b.add_prefill(f"for-peer-{i}", 1500, prefill_pairs(1500, 0))
                b.done(f"for-peer-{i}")
        return a, b

    a, b = worker_pair(prefilling=True)
    step_a = a.model.decode_step_s(7, 7 * 400)
    req = shape(64, seed=9, slo_itl=step_a / 0.97)  # on both-0: a miss of about a third
    decision = pl.decide(req, [a, b], [a, b])
    assert decision.chosen.decode_worker == "both-0", decision.reason
    on_b = [c for c in pl.candidates(req, [a, b], [a, b]) if c.decode_worker == "both-1"]
    assert all(c.itl_beside_s > req.slo_itl_s and c.new_miss(req) > 0.9 for c in on_b)
    assert 0.1 < decision.chosen.new_miss(req) < 0.9
    a, b = worker_pair(prefilling=False)
    calm = pl.decide(req, [a, b], [a, b])
    assert calm.chosen.decode_worker == "both-1", calm.reason
    assert calm.chosen.itl_beside_s == 0.0


def test_decodes_go_to_a_dedicated_decode_worker_before_one_of_both_kinds():
    """A dedicated decode worker, idle, and a worker of both kinds already decoding five: the
    decode gathers on the dedicated one (the worker of both kinds stays free to prefill)."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = trained("decode-0", "decode", seed=1)
    b = with_decodes(trained("both-0", "both", seed=2), 5, 300, itl_slo_s=10.0)
    chosen = pl.decide(shape(600, seed=4), [p, b], [d, b]).chosen
    assert chosen.decode_worker == "decode-0" and chosen.decode_lean == (False, False, 0), chosen


def test_on_a_tie_a_dedicated_decode_worker_takes_a_handoff_before_a_prefill_of_its_own():
    """Idle 1P+1D: prefilling on the decode worker comes a transfer sooner, and nothing tells
    the two apart on misses. The prompt goes to the prefill worker: its prefill on the decode
    worker would outlast an ITL SLO, beside the decodes to come there (the split from the first
    request on). A short prompt, a step's work there, takes the quicker first token."""
    pl = planner()
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    req = shape(900, seed=3, slo_itl=0.2)
    decision = pl.decide(req, [p], [d])
    colocated = next(c for c in decision.best if c.path is RoutePath.COLOCATED)
    chosen = decision.chosen
    assert chosen.path is RoutePath.DISAGGREGATED, decision.reason
    assert colocated.ttft_s < chosen.ttft_s  # it was the quicker, within the tolerance
    assert colocated.expected_misses(req) == pytest.approx(chosen.expected_misses(req), abs=0.01)
    assert colocated.decode_lean == (False, True, 0) and chosen.decode_lean == (False, False, 0)
    assert decision.reason_code == "cost_split", decision.reason
    assert "prefilled on prefill-0, not beside the decodes to come on decode-0" in decision.reason
    assert colocated.prefill_s > req.slo_itl_s
    short = shape(16, seed=3, slo_itl=0.2)
    assert pl.decide(short, [p], [d]).chosen.path is RoutePath.COLOCATED
    # Where it saves enough of the first token, the decode worker prefills the long one too.
    p.add_prefill("queued", 4000, prefill_pairs(4000, 0))
    assert pl.decide(req, [p], [d]).chosen.path is RoutePath.COLOCATED


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
    d.update_tail()
    assert d.itl_bias[False].samples == 0 and d.itl_spread.samples == 0
    assert d.itl_bias_factor(local=False) == 1.0 and len(d._request_tails) == 6
    d.observe_gaps([cold.itl_p99_s] * 60)
    d.update_tail()
    warm = handoff()
    assert warm.itl_checkable and warm.itl_floor_s > 0
    for _ in range(6):
        _finish(d, p, req, warm, [2.0 * warm.raw_itl_p99_s] * 50)
    d.update_tail()
    assert d.itl_bias[False].samples == 6 and d.itl_spread.samples == 6
    assert d.itl_bias_factor(local=False) == pytest.approx(2.0)
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


def test_decodes_gather_on_the_busiest_worker_of_both_kinds_that_has_room():
    """Three workers of both kinds decoding 3, 6 and 9 requests (loose SLOs: no miss expected
    anywhere): a new decode goes to the one running 9; once that one has no free sequence
    slot, to the one running 6."""
    pl = planner()
    ws = [
        with_decodes(trained(f"both-{i}", "both", seed=i), n, 300, itl_slo_s=10.0)
        for i, n in enumerate((3, 6, 9))
    ]
    req = shape(100, seed=6)
    assert pl.decide(req, ws, ws).chosen.decode_worker == "both-2"
    full = replace(ws[2].info, max_num_seqs=9)
    ws[2].info = full
    chosen = pl.decide(req, ws, ws).chosen
    assert chosen.decode_worker == "both-1", chosen
    on_full = [c for c in pl.candidates(req, ws, ws) if c.decode_worker == "both-2"]
    assert all(c.decode_lean[2] == 9 for c in on_full)


def test_a_worker_prefilling_now_and_then_sets_no_floor_under_a_decode_there():
    """One short prompt prefilled in the last half minute slows well under 1% of a decoding
    request's gaps: no floor. Twenty do."""
    d = with_decodes(trained("both-0", "both", seed=1), 4, 300, itl_slo_s=10.0)
    step = d.model.decode_step_s(5, 5 * 300)
    d.add_prefill("once", 200, prefill_pairs(200, 0))
    d.done("once")
    assert beside_floor(d, 5, 5 * 300, step) == 0.0
    for i in range(20):
        d.add_prefill(f"often-{i}", 200, prefill_pairs(200, 0))
        d.done(f"often-{i}")
    assert beside_floor(d, 5, 5 * 300, step) > step


def _shape_steps(rng: np.random.Generator, n: int, slower: float) -> tuple[StepStat, ...]:
    """`n` steps of mixed shapes timed by TRUE, `slower` times over."""
    out = []
    for _ in range(n):
        batch = int(rng.integers(1, 16))
        ctx = batch * int(rng.integers(16, 512))
        chunk = int(rng.choice([0, 0, 64, 256]))
        pairs = prefill_pairs(chunk, 0)
        out.append(
            StepStat(
                batch + chunk,
                chunk,
                pairs,
                batch,
                ctx,
                slower * true_step(batch + chunk, pairs, ctx),
            )
        )
    return tuple(out)


def test_workers_on_one_node_measure_how_much_slower_their_steps_run_beside_a_busy_peer():
    """both-0 and both-1 share a node; both-2 is on another. both-1's steps run 1.3x slower while
    both-0 has work: the node's share says 1.3 (both-2's, 1), both-1's model learns its steps
    alone and predicts them 1.3x slower while both-0 is busy."""

    class TwoNodes(FakeBackend):
        def worker_info(self, worker_id: str) -> WorkerInfo:
            node = "10.0.0.2" if worker_id == "both-2" else "10.0.0.1"
            return replace(super().worker_info(worker_id), node_ip=node)

    backend = TwoNodes(num_prefill=0, num_decode=0, num_both=3)
    infos = [backend.worker_info(w) for w in ("both-0", "both-1", "both-2")]
    metrics = Metrics()
    m = Membership(backend, infos, HandoffHealth(), metrics)
    a, b, c = (m.state(f"both-{i}") for i in range(3))
    assert a.host is b.host and c.host is not a.host
    rng = np.random.default_rng(7)

    def poll(busy_a: bool) -> None:
        if busy_a:
            a.add_decode("r", 100, 1.0, local=False)
        else:
            a.finish("r")
        slower = 1.3 if busy_a else 1.0
        m.absorb(
            [
                WorkerLoad(w.worker_id, w.info.role, 0, 0, 0, 0.0, 1024, 1024, 0, steps=steps)
                for w, steps in ((b, _shape_steps(rng, 4, slower)), (c, _shape_steps(rng, 4, 1.0)))
            ]
        )

    for _ in range(250):  # both-1 learns its steps alone first
        poll(busy_a=False)
    assert a.host.factor(PeerWork.DECODE) == 1.0
    for i in range(60):
        poll(busy_a=i % 2 == 0)
    assert a.host.factor(PeerWork.DECODE) == pytest.approx(1.3, rel=0.03)
    assert c.host.factor(PeerWork.DECODE) == 1.0
    share = metrics.registry.get_sample_value
    node_a = {"node": "10.0.0.1", "peer": "decode"}
    assert share("pdserve_node_step_share", node_a) == a.host.factor(PeerWork.DECODE)
    assert share("pdserve_node_step_share", {"node": "10.0.0.2", "peer": "decode"}) == 1.0
    assert b.model.scale == 1.0  # the last poll: both-0 idle
    alone = b.model.decode_step_s(8, 8 * 200)
    assert alone == pytest.approx(true_step(8, 0, 8 * 200), rel=0.05)
    assert b.shared_slowdown() == pytest.approx(1.3, rel=0.03)
    poll(busy_a=True)
    assert b.shared_slowdown() == 1.0
    assert b.model.decode_step_s(8, 8 * 200) == pytest.approx(1.3 * alone, rel=0.05)


def _sharing(factor: float, *workers: WorkerState, prefill: float | None = None) -> HostShare:
    """One node's share, measured at `factor` beside a decoding peer (and at `prefill`, or the
    same, beside a prefilling one) by a worker that ran each way, given to `workers` (on node
    10.0.0.1)."""
    share = HostShare()
    for _ in range(64):
        share.observe("other", 0, 1.0, 1.0, PeerWork.IDLE)
        share.observe("other", 0, 1.0, factor, PeerWork.DECODE)
        share.observe("other", 0, 1.0, prefill or factor, PeerWork.PREFILL)
    for w in workers:
        w.info = replace(w.info, node_ip="10.0.0.1")
        w.host = share
    return share


def test_a_nodes_share_counts_only_workers_that_ran_both_ways_and_reads_1_under_5_percent():
    share = HostShare()
    dec = PeerWork.DECODE
    for _ in range(64):  # a prefill worker whose decode worker always waits: busy steps only
        share.observe("prefill-0", 0, 1.0, 1.5, dec)
        share.observe("decode-0", 0, 1.0, 1.0, PeerWork.IDLE)
    assert share.factor(dec) == 1.0
    for _ in range(64):
        share.observe("decode-0", 0, 1.0, 1.03, dec)
    assert share.factor(dec) == 1.0  # 3%: noise, or separate GPUs
    for _ in range(128):  # the window's worth
        share.observe("decode-0", 0, 1.0, 1.3, dec)
    assert share.factor(dec) == pytest.approx(1.3)
    assert share.factor(PeerWork.PREFILL) == 1.0  # not measured beside a prefill: its prior
    assert share.factor(PeerWork.IDLE) == 1.0
    for _ in range(64):  # a replacement: its model, and its steps, start afresh
        share.observe("decode-0", 1, 1.0, 1.0, PeerWork.IDLE)
    assert share.factor(dec) == 1.0


def test_a_nodes_share_is_measured_for_each_kind_of_peer_work():
    """Two workers decoding on one CPU node slow each other more than a decode beside a peer's
    prefill (1.3x against 1.1x, as measured on a 2-core node): each kind has its own figure, and
    a worker's predicted steps carry the one for what its peers run now."""
    share = _sharing(1.3, prefill=1.1)
    assert share.factor(PeerWork.DECODE) == pytest.approx(1.3)
    assert share.factor(PeerWork.PREFILL) == pytest.approx(1.1)
    a, b = trained("prefill-0", "prefill", seed=1), trained("decode-0", "decode", seed=2)
    _sharing(1.3, a, b, prefill=1.1)
    alone = b.model.decode_step_s(4, 4 * 400)
    a.add_prefill("p", 500, prefill_pairs(500, 0))
    assert peer_work(b, [a, b]) is PeerWork.PREFILL
    b.set_peer_work(peer_work(b, [a, b]))
    assert b.model.decode_step_s(4, 4 * 400) == pytest.approx(1.1 * alone)
    assert b.shared_slowdown() == pytest.approx(1.3 / 1.1)
    a.add_decode("d", 100, 1.0, local=False)
    assert peer_work(b, [a, b]) is PeerWork.DECODE
    b.info = replace(b.info, node_ip="")
    assert peer_work(b, [a, b]) is PeerWork.IDLE  # its node unknown: it shares with none


def test_a_cpu_nodes_share_starts_at_its_prior_until_measured():
    """Workers on CPUs share the node's cores from the first request on, before any has run
    both ways: the share starts at CPU_PRIOR there (1 on GPUs), for each kind of peer work, and
    a measured figure replaces it."""
    cpu, gpu = HostShare.for_device("cpu"), HostShare.for_device("cuda")
    for k in (PeerWork.PREFILL, PeerWork.DECODE):
        assert cpu.factor(k) == HostShare.CPU_PRIOR[k] > 1.0 and gpu.factor(k) == 1.0
    for _ in range(32):
        cpu.observe("both-0", 0, 1.0, 1.0, PeerWork.IDLE)
        cpu.observe("both-0", 0, 1.0, 1.0, PeerWork.DECODE)
    assert cpu.factor(PeerWork.DECODE) == 1.0
    assert cpu.factor(PeerWork.PREFILL) == HostShare.CPU_PRIOR[PeerWork.PREFILL]


def test_a_decode_set_going_beside_a_peers_decodes_counts_the_misses_their_slower_steps_make():
    """both-0 decodes four requests 15% under their ITL SLO; both-1 is idle. Where they share a
    node whose steps run 1.3x slower beside a busy peer, a short prompt colocated on both-1 would
    push both-0's requests past their SLO: it decodes on both-0. On nodes of their own (or a
    share under 5%), colocating on both-1 costs nothing; nor does it once a third worker on the
    node is busy (both-0's steps carry the share already)."""
    pl = planner()
    a = with_decodes(trained("both-0", "both", seed=1), 4, 400, itl_slo_s=0.0)
    b = trained("both-1", "both", seed=2)
    step = a.model.decode_step_s(4, 4 * 400)
    for rid in list(a._decodes):
        a._decodes[rid].itl_slo_s = step / 0.85
    req = shape(64, seed=8, slo_ttft=20.0, slo_itl=0.2)

    def colocated_b() -> PathPrediction:
        return next(
            c
            for c in pl.candidates(req, [a, b], [a, b])
            if c.path is RoutePath.COLOCATED and c.decode_worker == "both-1"
        )

    _sharing(1.03, a, b)
    apart = pl.decide(req, [a, b], [a, b]).chosen
    assert (apart.path, apart.decode_worker) == (RoutePath.COLOCATED, "both-1"), apart
    assert apart.caused_misses == 0.0
    _sharing(1.3, a, b)
    assert colocated_b().caused_misses > 3.0
    shared = pl.decide(req, [a, b], [a, b]).chosen
    assert shared.decode_worker == "both-0", shared
    # The gaps measured on both-0 run 20% over its predicted step: they set what slows.
    a.observe_gaps([step * 1.2] * 100)
    a.update_tail()
    for rid in list(a._decodes):
        a._decodes[rid].itl_slo_s = step * 1.2 / 0.85
    assert colocated_b().caused_misses > 3.0
    # A third worker on the node is busy: both-0's steps already run beside a busy peer.
    c = trained("both-2", "both", seed=3)
    c.add_prefill("p", 500, prefill_pairs(500, 0))
    c.info, c.host = replace(c.info, node_ip="10.0.0.1"), a.host
    busy_peer = next(
        x
        for x in pl.candidates(req, [a, b, c], [a, b])
        if x.path is RoutePath.COLOCATED and x.decode_worker == "both-1"
    )
    assert busy_peer.caused_misses == 0.0
    # ... unless steps beside a prefilling peer run faster than beside a decoding one: a decode
    # set going on both-1 still slows both-0's (1.3 / 1.1 times).
    _sharing(1.3, a, b, c, prefill=1.1)
    beside_prefill = next(
        x
        for x in pl.candidates(req, [a, b, c], [a, b])
        if x.path is RoutePath.COLOCATED and x.decode_worker == "both-1"
    )
    assert beside_prefill.caused_misses > 1.0
    # Another node: its decodes slow nothing on both-0's.
    b.info = replace(b.info, node_ip="10.0.0.9")
    assert colocated_b().caused_misses == 0.0


def test_where_every_choice_misses_the_split_is_kept():
    """both-0 decodes four requests; both-1 decodes none. A 1500-token prompt under a 2 s TTFT
    SLO misses wherever it goes. Colocating on both-1 would miss by the least (no transfer), and
    set both-1 decoding too; the tie-break keeps the split: it decodes on both-0."""
    pl = planner()
    a = with_decodes(trained("both-0", "both", seed=1), 4, 400, itl_slo_s=10.0)
    b = trained("both-1", "both", seed=2)
    req = shape(1500, seed=9, slo_ttft=2.0, slo_itl=10.0)
    cands = pl.candidates(req, [a, b], [a, b])
    assert all(c.new_miss(req) > 0.99 for c in cands)
    colocated_b = next(
        c for c in cands if c.path is RoutePath.COLOCATED and c.decode_worker == "both-1"
    )
    decision = pl.decide(req, [a, b], [a, b])
    assert decision.chosen.decode_worker == "both-0", decision.reason
    assert colocated_b.violation(req) < decision.chosen.violation(req)
    assert decision.reason_code == "cost_gather_decodes", decision.reason


def test_the_first_requests_on_idle_workers_of_both_kinds_form_the_split():
    """Two idle workers of both kinds: the first request prefills on one and decodes on the
    other (a transfer's delay, not a worker that prefills beside its decodes). Before its first
    token, the second comes: its decode goes where one is to come, its prefill to the other."""
    pl = planner()
    a, b = trained("both-0", "both", seed=1), trained("both-1", "both", seed=2)
    by_id = {"both-0": a, "both-1": b}
    first = pl.decide(shape(300, seed=10, slo_ttft=20.0, slo_itl=10.0), [a, b], [a, b])
    assert first.chosen.path is RoutePath.DISAGGREGATED, first.reason
    assert first.reason_code == "cost_gather_decodes", first.reason
    assert "no prefill" in first.reason
    p, d = by_id[first.chosen.prefill_worker], by_id[first.chosen.decode_worker]
    p.add_prefill("first", 300, prefill_pairs(300, 0))
    d.add_decode("first", 300, 10.0, local=False)
    assert p.local_prefills == 0  # a prefill for a peer is no decode to come
    second = pl.decide(shape(300, seed=11, slo_ttft=20.0, slo_itl=10.0), [a, b], [a, b])
    assert second.chosen.decode_worker == d.worker_id, second.reason
    # A colocated request is a decode to come on its worker.
    p.done("first")
    p.add_prefill("local", 300, prefill_pairs(300, 0), local=True)
    assert p.local_prefills == 1


def test_a_placement_admission_would_refuse_counts_as_a_lost_request():
    """both-0 has a 4000-token prompt queued; both-1 decodes one request. A 100-token prompt
    queued behind the long one is predicted a 10.4 s first token under its 12 s SLO; prefilling
    it on both-1 would cost that running request 0.4 expected misses. With first tokens on time
    (margin 1) it queues on both-0. When they have lately come three times later than predicted,
    admission would refuse the queued placements: each is a certain miss that runs nothing (one
    expected miss), so it prefills on both-1 instead (0.4) and is admitted, where before it was
    refused with both-1 free."""
    from router.admission import refusal
    from router.books import RequestCounts
    from router.core_types import RouterConfig

    pl = planner()
    a = trained("both-0", "both", seed=1)
    a.add_prefill("long", 4000, prefill_pairs(4000, 0))
    b = with_decodes(trained("both-1", "both", seed=2), 1, 400, itl_slo_s=0.22)
    req = shape(100, seed=9, slo_ttft=12.0, slo_itl=10.0)
    on_time = pl.decide(req, [a, b], [a, b])
    assert on_time.chosen.prefill_worker in ("", "both-0"), on_time.reason
    assert on_time.chosen.queue_s > 10.0 and not on_time.chosen.refused
    pl.ttft_margin = 3.0
    assert refusal(req, on_time, RouterConfig(), RequestCounts(), 3.0) is not None
    late = pl.decide(req, [a, b], [a, b])
    queued = [c for c in pl.candidates(req, [a, b], [a, b]) if c.queue_s > 10.0]
    assert len(queued) == 2 and all(c.refused and c.expected_misses(req) == 1.0 for c in queued)
    assert "2 of 4 placements admission would refuse" in late.reason
    assert (late.chosen.prefill_worker or late.chosen.decode_worker) == "both-1", late.reason
    assert 0.3 < late.chosen.caused_misses < 0.5
    assert refusal(req, late, RouterConfig(), RequestCounts(), 3.0) is None
    # A request resumed after its decode worker died does not pass admission again: nothing is
    # marked refused for it.
    resumed = pl.candidates(req, [a, b], [a, b], admitting=False)
    assert not any(c.refused for c in resumed)
    # Tied on expected misses, an admitted placement is taken over a refused one, however much
    # later its first token comes.
    refused = replace(queued[0], ttft_s=10.0, refused=True, caused_misses=0.0)
    served = replace(queued[0], ttft_s=40.0, queue_s=0.0, refused=False, caused_misses=0.05)
    req30 = replace(req, slo_ttft_s=30.0)
    assert refused.ties(served.expected_misses(req30), req30) and served.ties(1.0, req30)
    assert choose([refused, served], req30) is served


def test_a_prefill_beside_decodes_is_not_a_queue():
    """A worker of both kinds decoding four requests, nothing queued: a prompt it prefills for
    its peer takes longer in chunks, but waits for nothing (admission refuses only what
    queueing pushes past its SLO)."""
    pl = planner()
    a = with_decodes(trained("both-0", "both", seed=1), 4, 400, itl_slo_s=10.0)
    b = trained("both-1", "both", seed=2)
    req = shape(600, seed=3)
    handoff = next(c for c in pl.candidates(req, [a, b], [a, b]) if c.prefill_worker == "both-0")
    assert handoff.queue_s == pytest.approx(0.0, abs=1e-9)
    assert handoff.prefill_s > a.model.prefill_s(600)  # in chunks beside the decodes
    a.add_prefill("queued", 300, prefill_pairs(300, 0))
    queued = next(c for c in pl.candidates(req, [a, b], [a, b]) if c.prefill_worker == "both-0")
    assert queued.queue_s > 0.1


def test_the_spread_of_predictions_near_their_slo_sets_the_width_of_a_miss_chance():
    """A quarter before any prediction near its SLO was checked; then the 68th percentile of
    |ln(measured / predicted)| over the latest 64, pooled with the prior as four predictions,
    within [8%, 100%]: the standard deviation of a normal error in log space, which the miss
    chance assumes."""

    def pooled(sigma: float, n: int, prior: float = PRIOR_WIDTH) -> float:
        return float(np.sqrt((4 * prior**2 + n * sigma**2) / (4 + n)))

    spread = PredictionSpread()
    for _ in range(20):
        spread.observe(0.01, 0.03, slo_s=1.0)  # 3x off, far under the SLO: decides nothing
    spread.observe(0.0, 0.5, slo_s=1.0)  # no prediction
    assert spread.samples == 0 and spread.width == PRIOR_WIDTH == 0.25
    for i in range(8):
        spread.observe(0.9, 0.9 * 1.5 ** (1 if i % 2 else -1), slo_s=1.0)
    assert spread.width == pytest.approx(pooled(np.log(1.5), 8), rel=1e-6)
    for _ in range(64):
        spread.observe(0.5, 5.0, slo_s=1.0)  # 10x off
    assert spread.width == 1.0
    for _ in range(64):
        spread.observe(1.0, 1.2, slo_s=1.0)  # the 10x errors leave the window
    assert spread.width == pytest.approx(pooled(np.log(1.2), 64), rel=1e-6)
    # Predictions that hold (as on a GPU, say) narrow it past the prior within a few dozen.
    good = PredictionSpread()
    for _ in range(20):
        good.observe(1.0, 1.01, slo_s=1.0)
    assert good.width == pytest.approx(pooled(np.log(1.01), 20), rel=1e-6) and good.width < 0.11
    # A normal error of that width in ln(measured / predicted): 0.5 at the SLO, 0.84 one
    # standard deviation past it.
    w = spread.width
    assert miss_chance(1.0, 1.0, w) == pytest.approx(0.5)
    assert miss_chance(np.exp(w), 1.0, w) == pytest.approx(0.8413, abs=1e-4)
    assert miss_chance(1.1, 1.0) == pytest.approx(0.88, abs=0.01)  # the floor: 88% at 10% over


def test_requests_predicted_past_their_slo_still_count_as_lost_to_a_prefill_beside_them():
    """decode-0 runs ten requests whose p99 gap is predicted at 1.5x their 100 ms SLO; prefill-0
    has a 3000-token prompt queued. A 200-token prompt colocated would start at once and run
    its prefill beside the ten (a 0.4 s step, 5x their SLO); handed off, it waits seconds, well
    within its 15 s TTFT SLO. While miss chances are as sharp as the models claim, the ten read
    as lost either way: every placement is a certain miss, and the quicker first token decides
    (which made the predictions come true on mixed at 0.8 req/s: measured p99 gaps at 1.0-1.1x
    the SLO, predicted at 1.3-2.6x). Once the worker's predictions are seen to err by a factor
    of 1.5, a request predicted at 1.5x may still attain, and 5x takes that chance away: the
    prefill goes to prefill-0. So it does on a worker whose predictions were never checked."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    p.add_prefill("long", 3000, prefill_pairs(3000, 0))
    d = trained("decode-0", "decode", seed=1)
    d.observe_gaps([0.06] * 90 + [0.15] * 10)  # median 60 ms, p99 150 ms
    d.update_tail()
    with_decodes(d, 10, 300, itl_slo_s=0.1)
    req = shape(200, seed=5, slo_ttft=15.0, slo_itl=0.1)

    sharp = pl.decide(req, [p], [d])
    assert sharp.chosen.path is RoutePath.COLOCATED, sharp.reason
    assert all(c.new_miss(req) > 0.99 and c.caused_misses < 0.1 for c in sharp.best)

    for i in range(8):  # ended requests: measured p99 gaps 1.5x off the predicted, either way
        predicted = 0.12
        d.observe_request(
            [0.06] * 90 + [predicted * 1.5 ** (1 if i % 2 else -1)] * 10, predicted, 0.1
        )
    assert d.itl_spread.width > 0.3
    wide = pl.decide(req, [p], [d])
    assert wide.chosen.path is RoutePath.DISAGGREGATED, wide.reason
    best = {c.path: c for c in wide.best}
    assert best[RoutePath.COLOCATED].caused_misses > 1.0
    assert best[RoutePath.DISAGGREGATED].caused_misses < 0.5
    assert 0.5 < best[RoutePath.DISAGGREGATED].new_miss(req) < 0.95  # may still attain
    assert best[RoutePath.DISAGGREGATED].ttft_s > 2 * best[RoutePath.COLOCATED].ttft_s
    assert wide.reason_code == "cost_misses", wide.reason
    # A worker whose predictions were never checked is taken to err by a quarter: the same.
    d.itl_spread = PredictionSpread()
    assert pl.decide(req, [p], [d]).chosen.path is RoutePath.DISAGGREGATED


def test_expected_misses_within_a_tenth_tie_wherever_they_fall():
    """0.99 and 1.01 expected misses tie (rounded down to tenths they did not, and the former
    won however much later its first token came): within the tie, the quicker first token."""
    d = trained("decode-0", "decode", seed=1)
    req = shape(100, seed=3)
    c = planner().candidates(req, [], [d])[0]
    assert c.new_miss(req) < 1e-6
    slow = replace(c, ttft_s=5.0, caused_misses=0.99)
    quick = replace(c, ttft_s=1.0, caused_misses=1.01)
    assert choose([slow, quick], req) is quick
    assert choose([slow, replace(quick, caused_misses=1.1)], req) is slow


def test_a_prefill_placed_after_a_colocated_one_counts_the_misses_of_its_decode_to_come():
    """both-0 has a 300-token prompt queued for a request that decodes there too; its decode
    steps will take about 25 ms, and a 1000-token prefill placed after it runs its chunks beside
    them, cut to the 200 ms step target. With an ITL SLO of 100 ms, the new prompt colocated
    there, or prefilled there for both-1, costs that request about one expected miss; with 500
    ms, none (chunks uncut, about a second, would have). Decoding there, the new request only
    adds one to its batch: no miss. A prefill queued there for a peer has no decode to come, and
    one that can no longer attain guards nothing."""

    a = trained("both-0", "both", seed=1, step_target_s=0.2)
    b = trained("both-1", "both", seed=2)
    transfer = planner().transfer
    new = shape(1000, seed=3)

    def costs() -> tuple[float, float, float]:
        colo = predict_colocated(new, a, Bias())
        prefill_here = predict_disaggregated(new, a, b, transfer, Bias())
        decode_here = predict_disaggregated(new, b, a, transfer, Bias())
        return colo.caused_misses, prefill_here.caused_misses, decode_here.caused_misses

    a.add_prefill("for-peer", 300, prefill_pairs(300, 0))
    assert costs() == (0.0, 0.0, 0.0)
    a.finish("for-peer")
    a.add_prefill("local", 300, prefill_pairs(300, 0), local=True, itl_slo_s=0.1)
    assert a.batch == 0 and a.coming_itl_slos() == [0.1]
    colo, prefill_here, decode_here = costs()
    assert colo > 0.9 and prefill_here > 0.9 and decode_here < 0.01
    assert predict_colocated(new, a, Bias()).prefill_beside == 1
    a.finish("local")
    a.add_prefill("local", 300, prefill_pairs(300, 0), local=True, itl_slo_s=0.5)
    assert max(costs()) < 0.01
    assert predict_colocated(new, a, Bias()).prefill_beside == 0
    a.unprotect("local")  # past its TTFT SLO before its first token
    assert a.coming_itl_slos() == [] and costs() == (0.0, 0.0, 0.0)


def test_a_placement_is_predicted_under_the_step_target_it_sets_on_its_decode_worker():
    """both-0 runs 800 ms steps (a target from a loose default SLO) beside its two decodes; a
    request with a 180 ms ITL SLO placed there brings the target down to 144 ms before its
    prefill runs (StepTargets.for_request), so its chunks are predicted at that target, and the
    worker's target is as it was after the decision."""
    from router.step_target import StepTargets

    d = with_decodes(trained("both-0", "both", seed=1, step_target_s=0.8), 2, 400, 10.0)
    req = shape(2000, seed=4, slo_itl=0.18)

    def colocated(pl: Planner) -> PathPrediction:
        return next(c for c in pl.candidates(req, [d], [d]) if c.path is RoutePath.COLOCATED)

    before = colocated(planner())
    assert before.running_itl_s == pytest.approx(0.8, rel=0.05)
    tuned = planner()
    tuned.target_for = StepTargets().for_request
    after = colocated(tuned)
    assert after.running_itl_s == pytest.approx(0.8 * 0.18, rel=0.1)
    assert after.ttft_s > before.ttft_s  # smaller chunks: more steps
    assert d.model.step_target_s == 0.8


def test_gaps_over_steps_turn_predicted_steps_into_gaps_and_a_fresh_worker_takes_the_others():
    """The step-time model predicts a worker's steps (its forward passes); a request's ITL SLO
    holds the gaps it sees at the router, which also carry each token's way out of the engine.
    both-0's requests see gaps 1.5x its decode steps: its gaps over steps read 1.5 (steps
    without decodes do not count), the p99 gap predicted for a request there is 1.5x its step,
    and the misses a prefill causes its running requests count their gaps. both-1, fresh, takes
    both-0's figure until it has its own; both-0 keeps its own once its gaps leave the window."""
    backend = FakeBackend(num_prefill=0, num_decode=0, num_both=2)
    infos = [backend.worker_info(w) for w in ("both-0", "both-1")]
    metrics = Metrics()
    m = Membership(backend, infos, HandoffHealth(), metrics)
    a, b = (m.state(f"both-{i}") for i in range(2))
    for w, seed in ((a, 1), (b, 2)):
        t = trained(w.worker_id, "both", seed=seed)
        w.model, w.itl_spread = t.model, t.itl_spread
    pl = planner()
    step = pl.candidates(shape(16), [], [a])[0].itl_s
    req = shape(16, slo_itl=1.2 * step)  # its step under the SLO, 1.5x it over
    before = pl.candidates(req, [], [a])[0]
    assert before.itl_gap_factor == 1.0 and before.new_miss(req) < 0.05

    decode_s = true_step(8, 0, 8 * 200)
    decode = StepStat(8, 0, 0.0, 8, 8 * 200, decode_s)
    prefill = StepStat(
        512, 512, prefill_pairs(512, 0), 0, 0, true_step(512, prefill_pairs(512, 0), 0)
    )
    load = WorkerLoad("both-0", a.info.role, 8, 0, 0, 0.1, 1000, 1024, 0, steps=(decode,) * 20)
    a.observe_gaps([1.5 * decode_s] * 30)
    m.absorb([replace(load, steps=(decode,) * 19 + (prefill,) * 40)])
    assert a.gap_factor() == 1.0  # 19 decode steps: too few yet
    m.absorb([load])
    assert a.gap_factor() == pytest.approx(1.5, rel=0.01)
    assert b.measured_gap_factor is None and b.gap_factor() == pytest.approx(1.5, rel=0.01)
    gauge = metrics.registry.get_sample_value
    ratio = gauge("pdserve_worker_gap_over_step_ratio", {"worker": "both-1"})
    assert ratio == pytest.approx(1.5, rel=0.01)

    after = pl.candidates(req, [], [a])[0]
    assert after.itl_gap_factor == pytest.approx(1.5, rel=0.01)
    assert after.itl_p99_s == pytest.approx(1.5 * after.itl_s, rel=0.01)
    assert after.new_miss(req) > 0.9

    # Four requests decoding with a 100 ms SLO: a prefill whose steps take 70 ms leaves them
    # under it as steps, past it as gaps (105 ms).
    with_decodes(a, 4, 200, itl_slo_s=0.1)
    assert caused_misses(a, 0.07, 0.03) > 2.0
    # ... and those at risk beside a prefill whose 40 ms steps take 60 ms gaps, twice under
    # their SLO as steps, not as gaps.
    assert prefills_beside(a, 0.04) == 4
    measured = a.measured_gap_factor
    a._gap_factor, a.peers_gap_factor = None, 1.0
    assert caused_misses(a, 0.07, 0.03) < 0.5
    assert prefills_beside(a, 0.04) == 0

    a._gap_factor = measured  # once measured, it holds after its gaps leave the window
    a.update_tail(window_s=0.0)
    assert a.gap_factor() == measured


def test_a_step_weighs_as_many_gaps_as_it_has_decodes():
    """20 steps of one decode at 20 ms and 20 of eight at 60 ms give 20 gaps of 20 ms and 160
    of 60 ms: the gaps are the steps (1.0), though the median of the steps alone is 40 ms."""
    w = trained("both-0", "both", seed=1)
    one, eight = StepStat(1, 0, 0.0, 1, 200, 0.02), StepStat(8, 0, 0.0, 8, 1600, 0.06)
    load = WorkerLoad("both-0", w.info.role, 8, 0, 0, 0.1, 1000, 1024, 0)
    w.absorb(replace(load, steps=(one,) * 20 + (eight,) * 20))
    w.observe_gaps([0.02] * 20 + [0.06] * 160)
    w.update_tail()
    assert w.gap_factor() == pytest.approx(1.0)


def _arrivals(pl: Planner, rate: float, seconds: float = 10.0) -> None:
    """Requests of 300 prompt tokens that decoded 100 each, arriving at `rate` for `seconds`."""
    now = time.monotonic()
    for i in range(int(rate * seconds)):
        pl.demand.arrived(300, 100, now=now - seconds + i / rate)
        pl.demand.ended(100, 100)


def test_decodes_spread_over_as_many_workers_as_the_rate_needs():
    """both-0 decodes 14 requests whose ITL SLO its step at 15 holds (at 0.9); both-1 and both-2,
    on the same node (a decoding peer slows steps 1.25x), decode none. One request at a time, a
    15th decode on both-0 costs each of its requests a few percent, one on both-1 costs all 14
    the node's share: gathering wins each decision. At 1 req/s (100 tokens each) one worker holds
    the SLO in steady state and gathering is right. At 4 req/s its batch would grow to about 40,
    gaps of 104 ms against a 58 ms SLO, while two workers would hold it (56 ms with the share):
    the decodes need two, and the new request decodes on both-1, its share not counted; both-2
    stays free to prefill. With two workers only, one stays free to prefill: decodes gather."""
    a = trained("both-0", "both", seed=1)
    b = trained("both-1", "both", seed=2)
    c = trained("both-2", "both", seed=3)
    _sharing(1.25, a, b, c)
    slo = a.model.decode_step_s(15, 15 * 400) / 0.9
    with_decodes(a, 14, 400, itl_slo_s=slo)
    req = shape(16, seed=8, slo_ttft=20.0, slo_itl=slo)

    slow = planner()
    _arrivals(slow, rate=1.0)
    assert slow.demand.rate() == pytest.approx(1.0, rel=0.05)
    assert slow.demand.workers_needed([a, b, c], slo) == 1
    gathered = slow.decide(req, [a, b, c], [a, b, c])
    assert gathered.chosen.decode_worker == "both-0", gathered.reason
    assert "decodes need" not in gathered.reason

    fast = planner()
    _arrivals(fast, rate=4.0)
    one = fast.demand.p99_gap(a, 4.0, 100, 350)
    two = fast.demand.p99_gap(a, 2.0, 100, 350, share=1.25)
    assert one > 1.5 * slo and two < slo
    assert fast.demand.workers_needed([a, b, c], slo) == 2
    spread = fast.decide(req, [a, b, c], [a, b, c])
    assert spread.chosen.decode_worker == "both-1", spread.reason
    assert spread.chosen.caused_misses < 0.1
    assert "decodes need 2 workers at 4." in spread.reason
    # Two workers: the second prefills.
    kept = fast.decide(req, [a, b], [a, b])
    assert kept.chosen.decode_worker == "both-0", kept.reason
    assert fast.decoders_needed == 1
    # Before eight requests came, the rate is not known: one worker.
    assert planner().demand.workers_needed([a, b, c], slo) == 1
    # A rate no worker holds: every batch grows without end (inf), and the count with the
    # shortest gaps is taken.
    flood = planner()
    _arrivals(flood, rate=400.0, seconds=0.5)
    assert flood.demand.p99_gap(a, 400.0, 100, 350) == float("inf")
    assert flood.demand.workers_needed([a, b, c], slo) == 1


def test_a_rate_the_decodes_cannot_hold_marks_the_decision_for_refusal():
    """One dedicated decode worker whose step at batch 15 holds the ITL SLO (at 0.9). At 1
    req/s of 100-token requests its steady-state batch holds it: nothing to refuse. At 4 req/s
    its batch would grow to about 40, and so does every count of the workers that may decode
    (one): once the worker runs (or has placed) as many decodes as it holds within the SLO,
    the decision carries the overload (the rate with this request, the p99 gap at best, those
    counts), and admission refuses it, naming the ITL SLO; with a place left, it is taken.
    Where the decodes may spread over two workers that hold it between them, nothing is
    refused; at a rate neither holds, not while the second has room. Before eight requests
    came, the rate is not known: nothing is refused. A request resumed elsewhere is not
    admitted again: no overload."""
    p, d = trained("prefill-0", "prefill", seed=1), trained("decode-0", "decode", seed=2)
    slo = d.model.decode_step_s(15, 15 * 400) / 0.9
    req = shape(16, seed=8, slo_ttft=20.0, slo_itl=slo)

    slow = planner()
    _arrivals(slow, rate=1.0)
    assert slow.decide(req, [p], [d]).overload is None

    fast = planner()
    _arrivals(fast, rate=4.0)
    # Past the rate, but the decode worker has room in its batch: a burst it may absorb.
    room = fast.demand.holds(d, slo, fast.demand.context())
    step = d.model.decode_step_s  # its gaps are its steps (factor and tail 1), context 350
    assert step(room, room * 350) <= slo < step(room + 1, (room + 1) * 350)
    assert room >= 15
    # Its requests' slow gaps twice their typical one: half as long a step holds the SLO.
    d._tail = 2.0
    tight = fast.demand.holds(d, slo, fast.demand.context())
    assert 2 * step(tight, tight * 350) <= slo < 2 * step(tight + 1, (tight + 1) * 350)
    assert tight < room
    d._tail = 1.0
    assert fast.decide(req, [p], [d]).overload is None
    for i in range(room - 2):
        d.add_decode(f"r{i}", 400, slo, local=False)
    d.add_prefill("q", 16, prefill_pairs(16, 0), local=True, itl_slo_s=slo)  # one to come
    assert fast.decide(req, [p], [d]).overload is None  # one place left
    d.add_decode("last", 400, slo, local=False)
    decision = fast.decide(req, [p], [d])
    over = decision.overload
    assert over is not None and over.workers == 1, decision.reason
    assert (over.load, over.room) == (room, room)
    assert over.rate == pytest.approx(4.1, rel=0.05)  # 40 in 10 s, and this one
    assert over.p99_s > 1.5 * slo
    refused = refusal(req, decision, RouterConfig(), RequestCounts(), 1.0)
    assert refused is not None and refused.reason is RejectReason.DECODE_RATE
    assert f"past the ITL SLO {slo * 1000:.0f} ms, and {room} decodes run" in str(refused)
    assert refused.retry_after_s == pytest.approx(1 / over.rate)
    off = RouterConfig(decode_rate_admission=False)
    assert refusal(req, decision, off, RequestCounts(), 1.0) is None

    d2 = trained("decode-1", "decode", seed=3)
    assert fast.decide(req, [p], [d, d2]).overload is None
    # A rate no count of the two holds (their batches grow without end): refused only once
    # both are full; the first being so leaves room on the second.
    flood = planner()
    _arrivals(flood, rate=400.0, seconds=0.5)
    assert flood.decide(req, [p], [d, d2]).overload is None
    for i in range(flood.demand.holds(d2, slo, flood.demand.context())):
        d2.add_decode(f"s{i}", 400, slo, local=False)
    assert flood.decide(req, [p], [d, d2]).overload is not None
    assert planner().decide(req, [p], [d]).overload is None
    assert fast.decide(req, [p], [d], admitting=False).overload is None
    # An SLO a lone request's gaps already miss: refusing would not help it.
    lone = fast.demand.p99_gap(d, 0.0, 1.0, 300)
    hopeless = replace(req, slo_itl_s=lone / 2)
    assert fast.decide(hopeless, [p], [d]).overload is None
    # One that a lone request's gaps hold on its prompt (300), but not at the context a request
    # decodes with (350, halfway through its tokens): the worker holds no decode within it, and
    # refusing would not help either.
    assert step(1, 300) < step(1, 350)
    narrow = replace(req, slo_itl_s=(step(1, 300) + step(1, 350)) / 2)
    assert fast.demand.holds(d, narrow.slo_itl_s, fast.demand.context()) == 0
    assert fast.decide(narrow, [p], [d]).overload is None

    # Two workers of both kinds: under auto one stays free to prefill, so the decodes have one
    # worker, which 4 req/s is past; the colocated policy decodes on both, which hold it.
    a, b = trained("both-0", "both", seed=4), trained("both-1", "both", seed=5)
    req = replace(req, slo_itl_s=a.model.decode_step_s(15, 15 * 400) / 0.9)
    for i in range(fast.demand.holds(a, req.slo_itl_s, fast.demand.context())):
        a.add_decode(f"r{i}", 400, req.slo_itl_s, local=False)
    assert fast.decide(req, [a, b], [a, b]).overload is not None
    colocated = planner(Policy.COLOCATED)
    colocated.demand = fast.demand
    assert colocated.decide(req, [a, b], [a, b]).overload is None
    assert fast.decide(req, [a, b], [a, b], override=RoutePath.COLOCATED).overload is None


def test_the_rate_taken_reads_a_burst_over_at_least_the_minimum_span():
    """Ten requests within a second after a quiet spell read as 1 req/s (over MIN_SPAN_S), not
    10; at a steady 2 req/s the rate is 2 once the window fills; arrivals older than the window
    leave it. What a request decodes is what the recent ones asked for, times the share of it
    that the latest to end decoded: the first to end being the short ones does not shrink it."""
    demand = DecodeDemand()
    now = 1000.0
    for i in range(10):
        demand.arrived(100, 200, now=now - 1 + i * 0.1)
    assert demand.rate(now) == pytest.approx(10 / MIN_SPAN_S)
    assert demand.rate(now, extra=1) == pytest.approx(11 / MIN_SPAN_S)
    steady = DecodeDemand()
    for i in range(40):
        steady.arrived(100, 200, now=now - 20 + i * 0.5)
    assert steady.rate(now) == pytest.approx(2.0)  # 40 since the oldest, 20 s ago
    assert steady.output_len(now) == 200  # none ended: what they asked for
    steady.ended(20, 20)  # a short one ended first, all it asked for
    assert steady.output_len(now) == 200
    steady.ended(100, 200)  # one that stopped at half of what it asked for
    assert steady.output_len(now) == pytest.approx(200 * 120 / 220)
    assert steady.rate(now + 30) == 0.0  # all older than the window


def test_a_prompt_placed_behind_a_prefill_nearly_done_waits_only_for_what_is_left_of_it():
    """A poll says how many prompt tokens each request at the worker still has to compute. A
    prompt placed now then waits for the 100 tokens left of the one prefilling, not its whole
    prompt; one not yet at the worker has
    none computed, one gone from the worker's queue is computed (one token left until its first
    token comes), and a preempted one starts over."""
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode")
    p.add_prefill("a", 1000, prefill_pairs(1000, 0))
    p.add_prefill("b", 800, prefill_pairs(800, 0))
    req, transfer = shape(900, seed=7), TransferTimeModel()
    before = predict_disaggregated(req, p, d, transfer, Bias())
    assert p.queued_tokens == 1800

    p.absorb(load_of(p, ("a", 100), ("b", 800)))  # 900 of a's 1000 computed, b waiting whole
    assert p.queued_tokens == 100 + 800
    pairs = prefill_pairs(100, 900) + prefill_pairs(800, 0)  # a's last 100 after its first 900
    assert p.queued_pairs == pytest.approx(pairs)
    after = predict_disaggregated(req, p, d, transfer, Bias())
    assert after.prefill_s == pytest.approx(before.prefill_s)
    assert after.queue_s < 0.6 * before.queue_s
    wait, _ = p.model.chunked_s(900, pairs, 0, 0)
    assert after.queue_s == pytest.approx(wait, rel=0.05)

    p.add_prefill("c", 500, prefill_pairs(500, 0))
    p.absorb(load_of(p, ("b", 300)))  # a computed, c not yet at the worker
    assert p.queued_tokens == 1 + 300 + 500
    p.absorb(load_of(p, ("b", 1200), ("c", 500)))  # b held with a prefix the books took as cached
    assert p.queued_tokens == 1 + 800 + 500
    p.absorb(load_of(p, ("c", 100)))
    assert p.queued_tokens == 1 + 1 + 100
    p.absorb(load_of(p, ("c", 500)))  # preempted: its tokens to compute again
    assert p.queued_tokens == 1 + 1 + 500
    p.done("a")
    assert p.queued_tokens == 1 + 500


def test_a_bias_below_one_does_not_take_a_p99_gap_under_the_typical_gap():
    """Colocated requests on both-0 came at a third of their predicted p99 gap (the bias of
    such predictions, bounded at 1/3): the next colocated prediction is scaled down, but no
    further than its own step as a gap and the worker's median gap. A p99 under the typical
    gap is no prediction: it made colocated placements read as sure to attain."""
    a = trained("both-0", "both")
    raw = predict_colocated(shape(64), a, Bias()).raw_itl_p99_s
    for _ in range(6):
        a.observe_request([raw / 5] * 100, raw, 10.0, local=True, raw_p99_s=raw)
    a.update_tail()
    assert a.itl_bias_factor(local=True) == pytest.approx(1 / 3)
    c = predict_colocated(shape(64), a, Bias())
    assert c.itl_bias == pytest.approx(1 / 3)
    assert c.raw_itl_p99_s * c.itl_bias < c.itl_gap_s  # scaled alone, it would pass under
    assert c.itl_floor_s == 0 and c.itl_p99_s == pytest.approx(c.itl_gap_s)
    a.observe_gaps([2 * raw] * 60)  # its requests' gaps lately: twice the step
    a.update_tail()
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
        d.observe_request([1.6 * raw] * 100, raw, req.slo_itl_s, local=False, raw_p99_s=raw)
    d.update_tail()
    assert d.itl_bias[True].samples == 0
    assert d.itl_bias_factor(local=True) == d.itl_bias_factor(local=False) == pytest.approx(1.6)
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
        d.observe_request([raw] * 100, raw, req.slo_itl_s, local=True, raw_p99_s=raw)
    d.update_tail()
    assert d.itl_bias_factor(local=True) == pytest.approx(1.0)
    assert d.itl_bias_factor(local=False) == pytest.approx(1.6)


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
            w.observe_request([1.8 * raw] * 100, raw, req.slo_itl_s, local=True, raw_p99_s=raw)
            w.observe_request([raw] * 100, raw, req.slo_itl_s, local=False, raw_p99_s=raw)
        w.update_tail()
        assert w.itl_bias_factor(local=True) == pytest.approx(1.8)
        assert w.itl_bias_factor(local=False) == pytest.approx(1.0)
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
        old.itl_bias[True].observe(0.05, 0.10)
    m.absorb([WorkerLoad("decode-0", old.info.role, 0, 0, 0, 0.0, 1024, 1024, 0)])
    labels = {"kind": "colocated", "worker": "decode-0"}
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_prediction_bias_ratio", labels) == pytest.approx(2.0)
    backend.incarnation = 1
    new = m.state("decode-0")
    assert new is not old and new.info.incarnation == 1
    assert new.itl_bias_factor(local=True) == pytest.approx(2.0)
    # None received: that kind takes the worker's, over both kinds, carried too.
    assert new.itl_bias_factor(local=False) == pytest.approx(2.0)
    new.update_tail()
    assert new.itl_bias_factor(local=False) == pytest.approx(2.0)
    assert predict_colocated(shape(64), new, Bias()).itl_bias == pytest.approx(2.0)
    backend.decode_ids.remove("decode-0")
    m.absorb([])
    assert sample("pdserve_prediction_bias_ratio", labels) is None
    assert sample("pdserve_prediction_bias_ratio", {**labels, "kind": "received"}) is None


def test_a_prompt_queued_behind_a_colocated_one_prefills_beside_its_decode():
    """A prompt placed behind one that decodes where it prefills (colocated) runs its chunks
    beside that one's decode, sized to the step target, where one placed behind a prompt whose
    KV goes to a peer runs after it in whole-budget steps: both when the new prompt is to
    decode there too and when it prefills there for a peer."""
    pl = planner()
    w = trained("both-0", "both", seed=1, step_target_s=0.05)
    d = trained("decode-1", "decode", seed=2)
    m = w.model
    req = shape(512, seed=3)
    ahead, own = prefill_pairs(1024, 0), prefill_pairs(512, 0)

    def prefill_s() -> dict[str, float]:
        """The time until the prompt is computed on both-0: colocated, and for decode-1."""
        return {
            c.path.value: c.queue_s + c.prefill_s
            for c in pl.candidates(req, [w], [w, d])
            if w.worker_id in (c.prefill_worker, c.decode_worker)
        }

    w.add_prefill("for-a-peer", 1024, ahead, local=False)
    alone = m.chunked_s(1024 + 512, ahead + own, 0, 0)[0]
    paths = ("colocated", "disaggregated")
    assert prefill_s() == dict.fromkeys(paths, pytest.approx(alone))
    w.finish("for-a-peer")
    w.add_prefill("colocated", 1024, ahead, local=True, itl_slo_s=0.2)
    beside = m.chunked_s(1024, ahead, 0, 0)[0] + m.chunked_s(512, own, 1, 1024)[0]
    assert prefill_s() == dict.fromkeys(paths, pytest.approx(beside))
    assert beside > 1.2 * alone
    # A second colocated prompt, then one for a peer: the new prompt runs with the latter,
    # beside both decodes.
    two, peer = prefill_pairs(256, 0), prefill_pairs(128, 0)
    w.add_prefill("colocated-2", 256, two, local=True, itl_slo_s=0.2)
    w.add_prefill("for-a-peer-2", 128, peer, local=False)
    chain = (
        m.chunked_s(1024, ahead, 0, 0)[0]
        + m.chunked_s(256, two, 1, 1024)[0]
        + m.chunked_s(128 + 512, peer + own, 2, 1024 + 256)[0]
    )
    assert prefill_s() == dict.fromkeys(paths, pytest.approx(chain))


def test_prompts_held_for_the_decodes_running_wait_once_then_chunk_beside_those_to_come():
    """Where the worker holds prompts for its running decodes (they end within the hold), the
    prompts queued there wait them out once and then run without them; a colocated one among
    them decodes from its first token on, and the prompts after it chunk beside its decode: the
    hold is not counted again for it."""
    pl = planner()
    held = _holding(left=20)
    m = held.model
    wait = m.hold_wait_s(held.batch, held.context)
    assert wait is not None
    ahead, own = prefill_pairs(600, 0), prefill_pairs(400, 0)
    held.add_prefill("colocated", 600, ahead, local=True, itl_slo_s=0.2)
    c = pl.candidates(shape(400, seed=6), [], [held])[0]
    expect = wait + m.chunked_s(600, ahead, 0, 0)[0] + m.chunked_s(400, own, 1, 600, 0.0)[0]
    assert c.queue_s + c.prefill_s == pytest.approx(expect)
    assert m.chunked_s(400, own, 1, 600)[0] > m.chunked_s(400, own, 1, 600, 0.0)[0]


def test_a_prompt_behind_a_colocated_one_costs_its_decode_chunks_where_the_running_are_waited_for():
    """The running decodes end within the hold, so a prompt placed now waits for them; a
    colocated prompt queued ahead of it decodes from its first token on, for all its output,
    and the worker does not hold the new prompt for that decode: the new prompt's chunks run
    beside it. Its step is the chunk's, on both paths, and its misses are counted."""
    pl = planner()
    held = _holding(left=20)
    m = held.model
    assert m.hold_wait_s(held.batch, held.context) is not None
    held.add_prefill("colocated", 600, prefill_pairs(600, 0), local=True, itl_slo_s=0.13)
    own = prefill_pairs(400, 0)
    step = coming_chunk_step(held, 400, own)
    assert step == pytest.approx(m.chunked_s(400, own, 41, 40 * 1000 + 600, 0.0)[1])
    assert step >= 0.15 > m.decode_step_s(41, 40 * 1000 + 600)  # the floor measured there
    # Only the colocated request is at risk: the running ones end before the new prompt runs.
    req = shape(400, seed=6)
    for c in pl.candidates(req, [held], [held, trained("decode-1", "decode", seed=2)]):
        if held.worker_id in (c.prefill_worker, c.decode_worker):
            assert c.caused_misses > 0.5, (c.path, c.caused_misses)
