"""How much workers on one node slow each other's steps (router/host_share.py), and the misses
a placement counts for it, with injected steps: no workers, no clock."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.step_stats import StepStat
from router.cost_model import prefill_pairs
from router.fake_backend import FakeBackend
from router.handoff_model import HandoffHealth
from router.host_share import HostShare, PeerWork
from router.membership import Membership
from router.metrics import Metrics
from router.pool_state import peer_work
from router.predictions import PathPrediction
from router.vocab import RoutePath
from tests.cost_fixtures import planner, shape, sharing, trained, true_step, with_decodes
from worker_protocol.messages import WorkerInfo, WorkerLoad


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
    share = sharing(1.3, prefill=1.1)
    assert share.factor(PeerWork.DECODE) == pytest.approx(1.3)
    assert share.factor(PeerWork.PREFILL) == pytest.approx(1.1)
    a, b = trained("prefill-0", "prefill", seed=1), trained("decode-0", "decode", seed=2)
    sharing(1.3, a, b, prefill=1.1)
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

    sharing(1.03, a, b)
    apart = pl.decide(req, [a, b], [a, b]).chosen
    assert (apart.path, apart.decode_worker) == (RoutePath.COLOCATED, "both-1"), apart
    assert apart.caused_misses == 0.0
    sharing(1.3, a, b)
    assert colocated_b().caused_misses > 3.0
    shared = pl.decide(req, [a, b], [a, b]).chosen
    assert shared.decode_worker == "both-0", shared
    # The gaps measured on both-0 run 20% over its predicted step: they set what slows.
    a.measured.observe_gaps([step * 1.2] * 100)
    a.measured.update_tail()
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
    sharing(1.3, a, b, c, prefill=1.1)
    beside_prefill = next(
        x
        for x in pl.candidates(req, [a, b, c], [a, b])
        if x.path is RoutePath.COLOCATED and x.decode_worker == "both-1"
    )
    assert beside_prefill.caused_misses > 1.0
    # Another node: its decodes slow nothing on both-0's.
    b.info = replace(b.info, node_ip="10.0.0.9")
    assert colocated_b().caused_misses == 0.0
