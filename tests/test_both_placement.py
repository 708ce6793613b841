"""Placement over workers of both kinds (and beside dedicated pools), with injected
measurements: no workers, no clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.cost_model import prefill_pairs
from router.interference import beside_floor
from router.policy import Policy
from router.pool_state import WorkerState
from router.predictions import choose, ttft_tolerance
from router.vocab import RoutePath
from tests.cost_fixtures import planner, shape, trained, with_decodes


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
    a.measured.observe_gaps([0.19] * 95 + [0.25] * 5)
    a.measured.update_tail()
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


def test_a_colocated_choice_kept_apart_names_the_worker_that_prefills_it():
    """Idle 1P+1D+1B, a 400-token prompt: colocated on the dedicated decode worker, not on the
    worker of both kinds where decodes are to come; the reason names where it is prefilled
    (a colocated placement has no prefill worker of its own)."""
    pl = planner()
    p, d = trained("prefill-0", "prefill"), trained("decode-0", "decode", seed=1)
    b = trained("both-0", "both", seed=2)
    decision = pl.decide(shape(400, seed=3, slo_itl=1.0), [p, b], [d, b])
    assert decision.chosen.path is RoutePath.COLOCATED and decision.reason_code == "cost_split"
    assert "prefilled on decode-0, not beside the decodes to come on both-0" in decision.reason


@pytest.mark.parametrize("how", ["override", "disaggregated", "threshold"])
def test_a_handoff_decodes_away_from_the_one_worker_that_can_prefill_it(how):
    """One worker of both kinds beside a dedicated decode worker: a handoff (asked by the
    client, by --policy disaggregated, or by the threshold) is prefilled on the worker of both
    kinds and decodes on the other, though the less loaded worker of both kinds would be picked
    to decode; it was then sent colocated there, "no worker other than its decode worker can
    prefill"."""
    both = trained("both-0", "both")
    dec = with_decodes(trained("decode-0", "decode", seed=1), 4, 200, 10.0)
    policy = {"override": Policy.AUTO, "disaggregated": Policy.DISAGGREGATED}.get(
        how, Policy.THRESHOLD
    )
    pl = planner(policy, threshold_tokens=10)
    asked = RoutePath.DISAGGREGATED if how == "override" else RoutePath.AUTO
    decision = pl.decide(shape(500), [both], [both, dec], asked)
    chosen = decision.chosen
    assert (chosen.path, chosen.prefill_worker, chosen.decode_worker) == (
        RoutePath.DISAGGREGATED, "both-0", "decode-0"
    ), decision.reason  # fmt: skip
    # A short prompt under the threshold stays colocated, on the less loaded worker; so does a
    # long one while the prefill queue is full (not moved next to decode-0's decodes).
    if how == "threshold":
        short = pl.decide(shape(8), [both], [both, dec])
        assert (short.chosen.path, short.chosen.decode_worker) == (RoutePath.COLOCATED, "both-0")
        assert short.reason == "colocated: 8 uncached tokens <= 10"
        full = planner(policy, threshold_tokens=10, threshold_queue=0)
        queued = full.decide(shape(500), [both], [both, dec])
        assert (queued.chosen.path, queued.chosen.decode_worker) == (
            RoutePath.COLOCATED, "both-0"
        ), queued.reason  # fmt: skip
        assert queued.reason == "colocated: the prefill queue holds >= 0 requests"


def test_the_threshold_sends_a_long_prompt_to_the_decode_worker_that_holds_it():
    """The threshold's first pick is the one worker of both kinds (the least loaded); the
    prompt is long there but cached on the dedicated decode worker, where a handoff would go:
    it runs colocated there, a short prefill, not the whole prompt on the first pick."""
    both = trained("both-0", "both")
    dec = with_decodes(trained("decode-0", "decode", seed=1), 12, 200, 10.0)
    req = shape(500)
    dec.prefix.insert(req.hashes)
    pl = planner(Policy.THRESHOLD, threshold_tokens=10)
    assert pl.decide(shape(8), [both], [both, dec]).chosen.decode_worker == "both-0"  # first pick
    decision = pl.decide(req, [both], [both, dec])
    assert (decision.chosen.path, decision.chosen.decode_worker) == (
        RoutePath.COLOCATED, "decode-0"
    ), decision.reason  # fmt: skip
    assert decision.reason.endswith("uncached tokens on decode-0 <= 10"), decision.reason


def test_the_threshold_hands_no_long_prompt_to_a_worker_that_could_never_reserve_its_kv():
    """Workers of both kinds let reservations for peers' KV hold at most half their blocks: a
    prompt over the threshold but over that half is not handed to one (its handoff would only
    fall back, no_reservation); it goes to a worker that can reserve it, else it is prefilled
    where it decodes, saying why."""
    a, b = trained("both-0", "both"), trained("both-1", "both", seed=1)
    req = shape(2000)
    blocks = -(-2000 // a.info.block_size)
    pl = planner(Policy.THRESHOLD, threshold_tokens=10)
    assert pl.decide(req, [a, b], [a, b]).chosen.path is RoutePath.DISAGGREGATED  # room: handed
    for w in (a, b):
        w.info = replace(w.info, num_blocks=blocks + 8, reserve_share=0.5)
    decision = pl.decide(req, [a, b], [a, b])
    assert decision.chosen.path is RoutePath.COLOCATED, decision.reason
    assert decision.reason == "colocated: no decode worker can reserve the KV of 2000 tokens"
    assert decision.reason_code == "threshold_local"
    # A dedicated decode worker beside them that can hold it takes the handoff.
    dec = with_decodes(trained("decode-0", "decode", seed=2), 4, 200, 10.0)
    chosen = pl.decide(req, [a, b], [a, b, dec]).chosen
    assert (chosen.path, chosen.decode_worker) == (RoutePath.DISAGGREGATED, "decode-0")
