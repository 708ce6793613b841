"""How many workers the decodes need at the rate requests come (router/capacity.py), and the
refusals admission makes past it, with injected arrivals: no workers, no clock."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from router.admission import refusal
from router.books import RequestCounts
from router.capacity import MIN_SPAN_S, DecodeDemand
from router.core_types import RouterConfig
from router.cost_model import prefill_pairs
from router.policy import Planner, Policy
from router.predictions import choose
from router.vocab import RejectReason, RoutePath
from tests.cost_fixtures import planner, shape, sharing, trained, with_decodes


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
    sharing(1.25, a, b, c)
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
    d.measured._tail = 2.0
    tight = fast.demand.holds(d, slo, fast.demand.context())
    assert 2 * step(tight, tight * 350) <= slo < 2 * step(tight + 1, (tight + 1) * 350)
    assert tight < room
    d.measured._tail = 1.0
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
    # Its hint: as often as a decode ends with `room` of them running.
    assert 0 < over.ends_per_s < over.rate
    assert refused.retry_after_s == pytest.approx(1 / over.ends_per_s)
    # A batch that never settles has no p99 gap to give: the refusal says so, not "inf ms".
    endless = replace(decision, overload=replace(over, p99_s=float("inf")))
    said = str(refusal(req, endless, RouterConfig(), RequestCounts(), 1.0))
    assert "inf" not in said and "a batch that keeps growing" in said, said
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
