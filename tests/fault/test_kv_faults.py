"""Faults injected into KV transfers between two connectors in this process (kv_transfer/faults.py):
each ends where its name says, within its deadline, on both sides, and the lane carries the next
transfer. Every transfer in the suite is checksummed (on by default on CPU); a corrupted layer is
caught by it."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from kv_transfer.base import FailureReason, TransferRequest, TransferStatus, send_all_layers
from kv_transfer.faults import FaultKind, FaultPlan
from kv_transfer.torch_dist import TorchDistConnector
from tests import kv_peers as kp

SCATTERED = ((7, 2, 11, 3, 0), (1, 9, 4, 14, 6))  # gathered and scattered through staging
RUNS = ((2, 3, 4), (5, 6, 7))  # one ascending run each side: sent and received in place


def req(tid, peer, ids, deadline_s=10.0):
    return TransferRequest(tid, peer, ids[0], ids[1], 4, deadline_s)


def pair(plan: FaultPlan | None, checksum: bool | None = None):
    lay = kp.layout()
    p = TorchDistConnector(lay, "cpu", replace(kp.FAST, faults=plan, checksum=checksum))
    d = kp.connector(lay)
    kp.pair_up(p, "P", d, "D")
    return p, d


def transfer(p, d, tid, ids, deadline_s=10.0, src_seed=3):
    src, dst = kp.cache(p.layout, 16, seed=src_seed), kp.cache(d.layout, 16, seed=None)
    d.start_recv(req(tid, "P", ids, deadline_s), dst)
    send_all_layers(p, req(tid, "D", ids, deadline_s), src)
    return src, dst


def ended(conn, tid, timeout_s=20.0):
    status = conn.wait(tid, timeout_s)
    res = conn.result(tid)
    conn.release(tid)
    return status, res.reason if res is not None else None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ids", [SCATTERED, RUNS], ids=["staged", "in-place"])
def test_a_corrupted_layer_is_caught_by_its_checksum(ids, ledger):
    p, d = pair(FaultPlan(FaultKind.CORRUPT))
    try:
        src, dst = transfer(p, d, "bad", ids)
        assert ended(d, "bad") == (TransferStatus.FAILED, FailureReason.CORRUPT)
        assert ended(p, "bad") == (TransferStatus.FAILED, FailureReason.CORRUPT)  # told by D
        assert p.faults is not None and p.faults.injected == 1
        ledger.add(injected=1)
        # The sender's cache is intact: the fault hit the message, not the blocks.
        again = kp.cache(p.layout, 16, seed=3)
        assert all(torch.equal(a, b) for a, b in zip(src.layers, again.layers))
        # A connector without faults moves the same blocks to the same receiver bit for bit.
        clean = kp.connector(p.layout)
        kp.pair_up(clean, "C", d, "D2")
        src2, dst2 = kp.cache(clean.layout, 16, seed=4), kp.cache(d.layout, 16, seed=None)
        d.start_recv(req("ok", "C", ids), dst2)
        send_all_layers(clean, req("ok", "D2", ids), src2)
        assert ended(d, "ok")[0] is ended(clean, "ok")[0] is TransferStatus.DONE
        kp.assert_blocks_equal(src2, dst2, *ids)
        clean.close()
    finally:
        p.close()
        d.close()


@pytest.mark.timeout(60)
def test_without_checksums_a_corrupted_layer_lands_unnoticed():
    p, d = pair(FaultPlan(FaultKind.CORRUPT), checksum=False)
    try:
        src, dst = transfer(p, d, "bad", SCATTERED)
        assert ended(d, "bad")[0] is ended(p, "bad")[0] is TransferStatus.DONE
        with pytest.raises(AssertionError):
            kp.assert_blocks_equal(src, dst, *SCATTERED)  # what the checksum is for
    finally:
        p.close()
        d.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "plan",
    [FaultPlan(FaultKind.DROP), FaultPlan(FaultKind.DELAY, delay_s=2.5)],
    ids=["drop", "delay"],
)
def test_a_dropped_or_late_transfer_ends_at_its_deadline_on_both_sides(plan, ledger):
    p, d = pair(plan)
    try:
        t0 = time.monotonic()
        transfer(p, d, "late", SCATTERED, deadline_s=1.5)
        got = ended(d, "late")
        took = time.monotonic() - t0
        assert got == (TransferStatus.FAILED, FailureReason.TIMEOUT)
        assert ended(p, "late")[0] is TransferStatus.FAILED
        assert 1.4 <= took < 1.5 + 2.0  # its deadline, not the io timeout
        ledger.add(injected=1)
        # A transfer that timed out leaves the pair itself up.
        assert p.connected("D") and d.connected("P")
    finally:
        p.close()
        d.close()


@pytest.mark.timeout(60)
def test_a_pair_broken_mid_stream_fails_both_ends_and_says_so(ledger):
    p, d = pair(FaultPlan(FaultKind.BREAK, after_layers=1))
    try:
        src, dst = kp.cache(p.layout, 16, seed=3), kp.cache(d.layout, 16, seed=None)
        d.start_recv(req("cut", "P", SCATTERED), dst)
        p.start_send(req("cut", "D", SCATTERED), src)
        p.send_layer("cut", 0)  # alone on the wire: the pair breaks after it
        time.sleep(0.3)
        for layer in (1, 2, 3):
            p.send_layer("cut", layer)
        assert ended(d, "cut") == (TransferStatus.FAILED, FailureReason.PEER_DEAD)
        ledger.add(injected=1)
        assert ended(p, "cut") == (TransferStatus.FAILED, FailureReason.PEER_DEAD)
        deadline = time.monotonic() + 10
        while d.connected("P"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not p.connected("D")
    finally:
        p.close()
        d.close()


def test_every_picks_which_sends_are_struck():
    from kv_transfer.faults import FaultInjector
    from kv_transfer.table import Transfer

    inj = FaultInjector(FaultPlan(FaultKind.DROP, every=3))
    recs = [Transfer.__new__(Transfer) for _ in range(9)]
    for r in recs:
        r.fault, r.fault_layers = False, 0
        inj.started(r)
    assert [r.fault for r in recs] == [False, False, True] * 3 and inj.injected == 3
    with pytest.raises(ValueError):
        FaultPlan(FaultKind.DELAY, delay_s=-1)
