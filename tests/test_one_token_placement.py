"""A request whose whole answer is its first token (max_tokens 1) has nothing to decode: it may
run whole on a worker that only prefills, so that no KV moves and the decode workers' steps are
left to their decodes. Placement with injected measurements: no workers, no clock."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from unittest.mock import Mock

import pytest

from router.books import RequestBooks, RequestCounts
from router.candidates import answering
from router.cost_model import prefill_pairs
from router.policy import Policy
from router.tracker import Tracker
from router.vocab import Frontend, RoutePath
from tests.cost_fixtures import planner, shape, trained, with_decodes
from worker_protocol.messages import TokenChunk


def _where(decision) -> tuple[RoutePath, str, str]:
    c = decision.chosen
    return c.path, c.prefill_worker, c.decode_worker


def test_only_a_request_of_one_token_may_run_whole_on_a_prefill_worker():
    p, both = trained("prefill-0", "prefill", seed=3), trained("both-0", "both", seed=5)
    d = trained("decode-0", "decode", seed=4)
    one, two = shape(200, max_tokens=1), shape(200, max_tokens=2)
    assert [w.worker_id for w in answering(one, [p, both], [d, both])] == [
        "prefill-0", "decode-0", "both-0"
    ]  # fmt: skip
    assert [w.worker_id for w in answering(two, [p, both], [d, both])] == ["decode-0", "both-0"]
    cands = planner().candidates(one, [p], [d])
    assert {(c.path, c.prefill_worker, c.decode_worker) for c in cands} == {
        (RoutePath.COLOCATED, "", "decode-0"),
        (RoutePath.COLOCATED, "", "prefill-0"),
        (RoutePath.DISAGGREGATED, "prefill-0", "decode-0"),  # never a handoff to prefill-0
    }
    assert all(c.decode_worker != "prefill-0" for c in planner().candidates(two, [p], [d]))


def test_auto_answers_a_one_token_request_on_the_prefill_worker_not_beside_decodes():
    """Beside 12 running decodes whose ITL SLO its prefill would push, or on an idle decode
    worker alike, a request of one token runs on the idle prefill worker: no transfer, and no
    decode's step slowed. One that decodes stays off it."""
    p = trained("prefill-0", "prefill", seed=3)
    busy = with_decodes(trained("decode-0", "decode", seed=4), 12, 512, 0.08)
    for d in (busy, trained("decode-0", "decode", seed=4)):
        decision = planner().decide(shape(300, max_tokens=1), [p], [d])
        assert _where(decision) == (RoutePath.COLOCATED, "", "prefill-0"), decision.reason
    decision = planner().decide(shape(300, max_tokens=2), [p], [busy])
    assert decision.chosen.decode_worker == "decode-0", decision.reason


def test_a_fixed_colocated_path_takes_the_least_loaded_worker_able_to_answer():
    """--policy colocated, a client's path, or prompt logprobs (computed where the prompt is):
    a request of one token goes to the least loaded of the decode and prefill workers; one that
    decodes goes to a decode worker. --policy disaggregated and the threshold hand it off as
    before (the fixed policies the bench compares)."""
    p = trained("prefill-0", "prefill", seed=3)
    d = with_decodes(trained("decode-0", "decode", seed=4), 8, 512, 1.0)
    one, two = shape(300, max_tokens=1), shape(300, max_tokens=2)
    pl = planner(Policy.COLOCATED)
    assert _where(pl.decide(one, [p], [d])) == (RoutePath.COLOCATED, "", "prefill-0")
    assert _where(pl.decide(two, [p], [d])) == (RoutePath.COLOCATED, "", "decode-0")
    for why in ("override", "prompt_logprobs"):
        asked = planner().decide(one, [p], [d], RoutePath.COLOCATED, why=why)
        assert _where(asked) == (RoutePath.COLOCATED, "", "prefill-0")
    # Idle alike: the prefill worker, leaving the decode worker to the decodes to come.
    idle = trained("decode-0", "decode", seed=4)
    assert _where(pl.decide(one, [p], [idle])) == (RoutePath.COLOCATED, "", "prefill-0")
    for policy in (Policy.DISAGGREGATED, Policy.THRESHOLD):
        pl = planner(policy, threshold_tokens=10)
        assert _where(pl.decide(one, [p], [d])) == (
            RoutePath.DISAGGREGATED, "prefill-0", "decode-0"
        )  # fmt: skip


def test_auto_answers_a_request_of_one_token_where_it_is_prefilled():
    """A handoff of a request with nothing to decode only adds a transfer to the same prefill:
    auto answers it where it is prefilled, though its prompt takes longer than an ITL SLO to
    prefill (a prefill beside decodes to come, were there any) and the colocated path's first
    tokens have lately come later than predicted (its bias, not the handoffs')."""
    p = trained("prefill-0", "prefill", seed=3)
    d = trained("decode-0", "decode", seed=4)
    req = shape(1500, max_tokens=1, slo_itl=0.05)
    pl = planner()
    assert p.model.prefill_s(1500, 0) > req.slo_itl_s
    decision = pl.decide(req, [p], [d])
    assert _where(decision) == (RoutePath.COLOCATED, "", "prefill-0"), decision.reason
    assert "no handoff: one token, nothing to decode" in decision.reason
    assert "prefill-0->decode-0" in decision.reason
    for _ in range(64):  # colocated first tokens twice as late as predicted
        pl.bias[RoutePath.COLOCATED].observe(1.0, 2.0)
    decision = pl.decide(req, [p], [d])
    assert decision.chosen.path is RoutePath.COLOCATED, decision.reason
    # Two tokens: the handoff stays a candidate auto may take.
    two = pl.decide(shape(1500, max_tokens=2, slo_itl=0.05), [p], [d])
    assert two.chosen.path is RoutePath.DISAGGREGATED, two.reason


def test_a_prefill_worker_that_has_prefilled_for_peers_still_answers_without_an_itl_miss():
    """A prefill worker's recent prefills for its peers make its steps beside them long, which
    a decode there would see: a request of one token has no gaps, so no ITL miss of its own is
    predicted anywhere, and it is answered on the idle prefill worker."""
    p = trained("prefill-0", "prefill", seed=3)
    for i in range(6):  # prefilled for peers in the last seconds, idle now
        p.add_prefill(f"peer-{i}", 1000, prefill_pairs(1000, 0))
        p.done(f"peer-{i}")
    d = trained("decode-0", "decode", seed=4)
    req = shape(300, max_tokens=1, slo_itl=0.05)
    cands = planner().candidates(req, [p], [d])
    assert all(c.itl_p99_s == 0.0 and c.new_miss(req) < 0.01 for c in cands)
    decision = planner().decide(req, [p], [d])
    assert _where(decision) == (RoutePath.COLOCATED, "", "prefill-0"), decision.reason
    # A prompt queued there: the decode worker's first token would come a little sooner.
    p.add_prefill("queued", 100, prefill_pairs(100, 0))
    decision = planner().decide(req, [p], [d])
    assert _where(decision) == (RoutePath.COLOCATED, "", "prefill-0"), decision.reason
    assert decision.reason_code == "cost_one_token", decision.reason
    assert (
        "answered on prefill-0 (a prefill worker): one token, nothing to decode" in decision.reason
    )
    # A request that decodes is priced with those prefills' steps, as before.
    two = planner().candidates(shape(300, max_tokens=2, slo_itl=0.05), [p], [d])
    assert all(c.itl_p99_s > 0 for c in two)


def test_a_request_of_one_token_is_booked_as_no_decode_to_come():
    """Booked on the prefill worker that answers it, a request of one token is a prefill there
    and never a decode (queued or running): a handoff through that worker is priced as if it
    were not there but for its prefill, and the split keeps a generation off the decode
    worker's decodes."""
    p = trained("prefill-0", "prefill", seed=3)
    d = with_decodes(trained("decode-0", "decode", seed=4), 2, 400, 0.2)
    gen = shape(600, seed=9, max_tokens=128, slo_itl=0.2)
    alone = planner().decide(gen, [p], [d])
    assert _where(alone) == (RoutePath.DISAGGREGATED, "prefill-0", "decode-0"), alone.reason
    states = {w.worker_id: w for w in (p, d)}
    for i in range(3):
        one = shape(16, seed=20 + i, max_tokens=1)
        chosen = planner().decide(one, [p], [d]).chosen
        assert chosen.decode_worker == "prefill-0"
        track = Tracker(f"one-{i}", 0.0, "colocated", Frontend.GRPC, 16, chosen.ttft_s)
        books = RequestBooks(f"one-{i}", track, Mock(), RequestCounts(), deque(), states, Mock())
        books.place(one, chosen)
        assert (p.queued_prefills, p.local_prefills, p.coming_itl_slos()) == (i + 1, 0, [])
    decision = planner().decide(gen, [p], [d])
    assert _where(decision) == (RoutePath.DISAGGREGATED, "prefill-0", "decode-0"), decision.reason
    assert decision.chosen.prefill_beside == 0


def test_a_request_of_one_token_is_not_refused_for_the_decodes_rate():
    """Where taking one more request that decodes would set a rate the decodes cannot hold
    (the decision carries the overload), a request of one token carries none: it decodes
    nowhere."""
    from tests.test_decode_capacity import _arrivals

    p, d = trained("prefill-0", "prefill", seed=1), trained("decode-0", "decode", seed=2)
    slo = d.model.decode_step_s(15, 15 * 400) / 0.9
    fast = planner()
    _arrivals(fast, rate=4.0)
    for i in range(fast.demand.holds(d, slo, fast.demand.context())):
        d.add_decode(f"r{i}", 400, slo, local=False)
    assert fast.decide(shape(16, seed=8, slo_ttft=20.0, slo_itl=slo), [p], [d]).overload
    one = fast.decide(shape(16, seed=8, max_tokens=1, slo_ttft=20.0, slo_itl=slo), [p], [d])
    assert one.overload is None and one.chosen.decode_worker == "prefill-0"


def test_a_prefill_worker_s_answer_takes_neither_the_colocated_nor_the_handoffs_correction():
    """Colocated first tokens (chunks beside decodes) twice as late as predicted, and handoffs
    (a transfer and more hops) three times, say nothing of a prefill worker's queue: its answer
    to a request of one token is predicted as the model has it until its own correction has
    seen enough answers."""
    p = trained("prefill-0", "prefill", seed=3)
    d = trained("decode-0", "decode", seed=4)
    pl = planner()
    for i in range(64):
        x = 0.2 + i / 64
        pl.bias[RoutePath.DISAGGREGATED].observe(x, 3 * x)
        pl.bias[RoutePath.COLOCATED].observe(x, 2 * x)
    req = shape(300, max_tokens=1)
    cands = {c.decode_worker: c for c in pl.candidates(req, [p], [d]) if not c.prefill_worker}
    assert cands["prefill-0"].ttft_s == pytest.approx(cands["prefill-0"].raw_ttft_s)
    assert cands["decode-0"].ttft_s == pytest.approx(2 * cands["decode-0"].raw_ttft_s, rel=0.05)


def test_a_request_of_one_token_is_handed_off_only_where_admission_takes_nothing_else():
    """Where admission would refuse every placement answering it where it is prefilled (their
    first tokens predicted past its TTFT SLO) but take a handoff, the handoff serves it."""
    a, b = trained("both-0", "both", seed=5), trained("both-1", "both", seed=6)
    pl = planner()
    req = shape(300, max_tokens=1, slo_ttft=1.0)
    cands = pl.candidates(req, [a, b], [a, b])
    local = [c for c in cands if c.path is RoutePath.COLOCATED]
    handoffs = [c for c in cands if c.path is RoutePath.DISAGGREGATED]
    refused = [replace(c, refused=True) for c in local]
    assert pl._auto(req, refused + handoffs, ()).chosen.path is RoutePath.DISAGGREGATED
    assert pl._auto(req, local + handoffs, ()).chosen.path is RoutePath.COLOCATED


def test_over_workers_of_both_kinds_a_request_of_one_token_goes_where_fewest_decodes_run():
    """It adds a prefill and no decode: of two workers of both kinds, the one running no
    decodes answers it (not the one its decodes gather on), and the reason says so without
    naming a prefill worker."""
    busy = with_decodes(trained("both-0", "both", seed=5), 3, 300, 1.0)
    idle = trained("both-1", "both", seed=6)
    for req in (shape(16, max_tokens=1), shape(100, seed=2, max_tokens=1)):
        decision = planner().decide(req, [busy, idle], [busy, idle])
        assert _where(decision) == (RoutePath.COLOCATED, "", "both-1"), decision.reason
        assert "a prefill worker" not in decision.reason
    # A request that decodes gathers its decodes where they run, as before.
    gather = planner().decide(shape(16, max_tokens=8), [busy, idle], [busy, idle])
    assert gather.chosen.decode_worker == "both-0", gather.reason


def test_a_one_token_handoff_guards_no_itl_on_its_decode_worker():
    """Handed off (here by the threshold), a request of one token holds blocks and a slot on
    its decode worker until its KV lands, but no ITL SLO there: no later placement is charged
    misses against it, and no step target is tuned for it."""
    p = trained("prefill-0", "prefill", seed=3)
    d = trained("decode-0", "decode", seed=4)
    req = shape(600, max_tokens=1, slo_itl=0.03)
    chosen = planner(Policy.THRESHOLD, threshold_tokens=10).decide(req, [p], [d]).chosen
    assert chosen.path is RoutePath.DISAGGREGATED
    track = Tracker("one", 0.0, "disaggregated", Frontend.GRPC, 600, chosen.ttft_s)
    states = {w.worker_id: w for w in (p, d)}
    RequestBooks("one", track, Mock(), RequestCounts(), deque(), states, Mock()).place(req, chosen)
    assert d.batch == 1 and d.min_itl_slo_s == float("inf")


def test_a_prefill_worker_s_answers_are_predicted_with_their_own_trained_correction():
    """Once the answers' own correction has seen enough first tokens (here twice as late as
    predicted), a prefill worker's answer is predicted with it, whatever the handoffs' says."""
    p, d = trained("prefill-0", "prefill", seed=3), trained("decode-0", "decode", seed=4)
    pl = planner()
    for i in range(64):
        x = 0.2 + i / 64
        pl.bias[RoutePath.DISAGGREGATED].observe(x, x)
        pl.answer_bias.observe(x, 2 * x)  # its own, trained
    c = next(c for c in pl.candidates(shape(300, max_tokens=1), [p], [d]) if c.answered)
    assert c.decode_worker == "prefill-0"
    assert c.ttft_s == pytest.approx(2 * c.raw_ttft_s, rel=0.05)


def test_a_request_of_one_token_is_priced_with_no_step_target_and_no_node_share():
    """A step target the placement would set, and the misses that setting a worker decoding
    causes among its node's peers, price a request that decodes; one of one token sets
    neither, and is priced as if neither were there."""
    from tests.cost_fixtures import sharing

    peer = with_decodes(trained("decode-1", "decode", seed=7), 12, 400, 0.06)
    d = trained("decode-0", "decode", seed=4)
    sharing(1.6, d, peer)
    pl = planner()
    one, two = shape(300, max_tokens=1, slo_itl=0.06), shape(300, max_tokens=2, slo_itl=0.06)

    def on_d(req):
        return next(c for c in pl.candidates(req, [], [d, peer]) if c.decode_worker == "decode-0")

    plain_one, plain_two = on_d(one), on_d(two)
    assert plain_two.caused_misses > plain_one.caused_misses == 0.0  # the node share

    def on_peer(req):  # beside its 12 decodes, chunked to its step target
        return next(c for c in pl.candidates(req, [], [d, peer]) if c.decode_worker == "decode-1")

    peer.model.step_target_s = 1.0
    before_one, before_two = on_peer(one), on_peer(two)
    pl.target_for = lambda w, slo: 1e-4  # a target far under every chunk, once placed there
    assert on_peer(one) == before_one
    assert on_peer(two).ttft_s > before_two.ttft_s


def test_the_first_token_of_a_request_of_one_token_books_no_decode():
    """Its first (and only) token ends its prefill on the worker that answers it, and books no
    decode there."""
    p, d = trained("prefill-0", "prefill", seed=3), trained("decode-0", "decode", seed=4)
    one = shape(16, max_tokens=1)
    chosen = planner().decide(one, [p], [d]).chosen
    assert chosen.decode_worker == "prefill-0"
    track = Tracker("one", 0.0, "colocated", Frontend.GRPC, 16, chosen.ttft_s)
    states = {w.worker_id: w for w in (p, d)}
    books = RequestBooks("one", track, Mock(), RequestCounts(), deque(), states, Mock())
    books.place(one, chosen)
    chunk = TokenChunk("one", (7,), True, "length", 16, 0, "prefill-0", time.monotonic())
    books.took(chunk)
    assert (p.queued_prefills, p.batch) == (0, 0)
