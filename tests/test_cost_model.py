"""Path choice with the cost model: what each path would cost a request and what it would cost
the requests running, with injected measurements: no workers, no clock."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from engine.step_stats import StepStat
from router.balancer import pick_decode
from router.cost_model import prefill_pairs
from router.fake_backend import FakeBackend
from router.handoff_model import HandoffHealth, TransferTimeModel
from router.interference import caused_misses, prefills_beside
from router.membership import Membership
from router.metrics import Metrics
from router.placement_costs import predict_colocated, predict_disaggregated
from router.policy import Planner, Policy, PolicyConfig
from router.pool_state import WorkerState
from router.predictions import PathPrediction, choose
from router.spread import PRIOR_WIDTH, PredictionSpread, miss_chance
from router.ttft_bias import Bias
from router.vocab import RoutePath
from tests.cost_fixtures import planner, shape, trained, true_step, with_decodes
from worker_protocol.messages import WorkerLoad


def load_of(w: WorkerState, *left: tuple[str, int]) -> WorkerLoad:
    """A poll of `w` with nothing but the prompt tokens its requests still have to compute."""
    queued = sum(n for _, n in left)
    return WorkerLoad(
        w.worker_id, w.info.role, 0, 0, 0, 0.1, 1000, 1024, queued, prefills_left=left
    )


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


def test_auto_hands_no_prompt_to_a_worker_whose_reservations_could_never_hold_its_kv():
    """A worker that also prefills lets reservations for peers' KV hold at most half its
    blocks: a prompt over that would fall back (no_reservation) on an idle server."""
    p, d = trained("prefill-0", "prefill", seed=3), trained("decode-0", "decode", seed=4)
    with_decodes(d, 8, 512, 1.0)
    req = shape(2000, max_tokens=64)
    blocks = -(-2000 // d.info.block_size)
    d.info = replace(d.info, num_blocks=blocks + 8)  # it holds the prompt, alone
    assert planner().decide(req, [p], [d]).chosen.path is RoutePath.DISAGGREGATED
    d.info = replace(d.info, reserve_share=0.5)  # not within half of its blocks
    decision = planner().decide(req, [p], [d])
    assert decision.chosen.path is RoutePath.COLOCATED
    assert decision.reason_code == "handoff_no_room", decision.reason
    assert "decode-0 cannot reserve the prompt's KV" in decision.reason
    short = shape(blocks * d.info.block_size // 3, max_tokens=64)  # within half: a candidate
    cands = planner().candidates(short, [p], [d])
    assert not any(c.no_room for c in cands)


def test_a_handoff_asked_for_goes_to_a_decode_worker_that_can_reserve_its_kv():
    """--policy disaggregated (or a client's path) takes the least loaded decode worker, but
    not one whose reservations could never hold the prompt's KV while another can."""
    p = trained("prefill-0", "prefill", seed=3)
    busy, both = trained("decode-0", "decode", seed=4), trained("both-0", "both", seed=5)
    with_decodes(busy, 8, 512, 1.0)
    req = shape(2000, max_tokens=64)
    blocks = -(-2000 // both.info.block_size)
    pl = planner(Policy.DISAGGREGATED)
    assert pl.decide(req, [p, both], [busy, both]).chosen.decode_worker == "both-0"
    both.info = replace(both.info, num_blocks=blocks + 8, reserve_share=0.5)
    chosen = pl.decide(req, [p, both], [busy, both]).chosen
    assert (chosen.path, chosen.prefill_worker, chosen.decode_worker) == (
        RoutePath.DISAGGREGATED,
        "prefill-0",
        "decode-0",
    )


def test_the_reason_weighs_the_choice_against_a_placement_that_could_be_taken():
    """A handoff to a worker of both kinds that cannot reserve the prompt is no rival: where
    another handoff could be taken and lost on cost, the reason compares with that one."""
    p = trained("prefill-0", "prefill", seed=3)
    busy, both = trained("decode-0", "decode", seed=4), trained("both-0", "both", seed=5)
    with_decodes(busy, 30, 512, 0.08)  # a handoff to it costs its decodes their ITL SLO
    req = shape(2000, max_tokens=64)
    blocks = -(-2000 // both.info.block_size)
    both.info = replace(both.info, num_blocks=blocks + 8, reserve_share=0.5)
    decision = planner().decide(req, [p], [busy, both])
    assert (decision.chosen.path, decision.chosen.decode_worker) == (RoutePath.COLOCATED, "both-0")
    assert decision.reason_code == "cost_misses", decision.reason
    assert "vs disaggregated" in decision.reason and "prefill-0->decode-0" in decision.reason
    # A worker of both kinds whose share of sequence slots is under one takes no reservation.
    one = replace(both.info, num_blocks=10 * blocks, max_num_seqs=1)
    both.info = one
    assert all(c.no_room for c in planner().candidates(req, [p], [both]) if c.prefill_worker)


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
    d.measured.observe_gaps([0.06] * 90 + [0.15] * 10)  # median 60 ms, p99 150 ms
    d.measured.update_tail()
    with_decodes(d, 10, 300, itl_slo_s=0.1)
    req = shape(200, seed=5, slo_ttft=15.0, slo_itl=0.1)

    sharp = pl.decide(req, [p], [d])
    assert sharp.chosen.path is RoutePath.COLOCATED, sharp.reason
    assert all(c.new_miss(req) > 0.99 and c.caused_misses < 0.1 for c in sharp.best)

    for i in range(8):  # ended requests: measured p99 gaps 1.5x off the predicted, either way
        predicted = 0.12
        d.measured.observe_request(
            [0.06] * 90 + [predicted * 1.5 ** (1 if i % 2 else -1)] * 10, predicted, 0.1
        )
    assert d.measured.itl_spread.width > 0.3
    wide = pl.decide(req, [p], [d])
    assert wide.chosen.path is RoutePath.DISAGGREGATED, wide.reason
    best = {c.path: c for c in wide.best}
    assert best[RoutePath.COLOCATED].caused_misses > 1.0
    assert best[RoutePath.DISAGGREGATED].caused_misses < 0.5
    assert 0.5 < best[RoutePath.DISAGGREGATED].new_miss(req) < 0.95  # may still attain
    assert best[RoutePath.DISAGGREGATED].ttft_s > 2 * best[RoutePath.COLOCATED].ttft_s
    assert wide.reason_code == "cost_misses", wide.reason
    # A worker whose predictions were never checked is taken to err by a quarter: the same.
    d.measured.itl_spread = PredictionSpread()
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
        w.model, w.measured.itl_spread = t.model, t.measured.itl_spread
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
    a.measured.observe_gaps([1.5 * decode_s] * 30)
    m.absorb([replace(load, steps=(decode,) * 19 + (prefill,) * 40)])
    assert a.measured.gap_factor() == 1.0  # 19 decode steps: too few yet
    m.absorb([load])
    assert a.measured.gap_factor() == pytest.approx(1.5, rel=0.01)
    assert b.measured.own_gap_factor is None and b.measured.gap_factor() == pytest.approx(
        1.5, rel=0.01
    )
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
    measured = a.measured.own_gap_factor
    a.measured._gap_factor, a.measured.peers_gap_factor = None, 1.0
    assert caused_misses(a, 0.07, 0.03) < 0.5
    assert prefills_beside(a, 0.04) == 0

    a.measured._gap_factor = measured  # once measured, it holds after its gaps leave the window
    a.measured.update_tail(window_s=0.0)
    assert a.measured.gap_factor() == measured


def test_a_step_weighs_as_many_gaps_as_it_has_decodes():
    """20 steps of one decode at 20 ms and 20 of eight at 60 ms give 20 gaps of 20 ms and 160
    of 60 ms: the gaps are the steps (1.0), though the median of the steps alone is 40 ms."""
    w = trained("both-0", "both", seed=1)
    one, eight = StepStat(1, 0, 0.0, 1, 200, 0.02), StepStat(8, 0, 0.0, 8, 1600, 0.06)
    load = WorkerLoad("both-0", w.info.role, 8, 0, 0, 0.1, 1000, 1024, 0)
    w.absorb(replace(load, steps=(one,) * 20 + (eight,) * 20))
    w.measured.observe_gaps([0.02] * 20 + [0.06] * 160)
    w.measured.update_tail()
    assert w.measured.gap_factor() == pytest.approx(1.0)


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
