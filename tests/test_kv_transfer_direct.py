"""KV transfer straight from and into the cache: when a side's block ids form one ascending run,
that side sends from (or receives into) `layer[a:a+n]` instead of copying through staging. Bit for
bit in every mix of contiguous and scattered ids, and the ownership contract while such a message
is on the wire: an abort or a deadline never hands blocks back while the wire may still read or
write them."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from engine.kv_cache import KVCache
from kv_transfer.base import FailureReason, TransferRequest, TransferStatus, send_all_layers
from kv_transfer.pair import Pair
from kv_transfer.staging import Staging
from kv_transfer.table import Role, TransferTable
from kv_transfer.wire import HEADER_TAG
from tests import kv_peers as kp

RUN_SRC = (3, 4, 5, 6, 7)
RUN_DST = (9, 10, 11, 12, 13)
SCATTERED_SRC = (7, 2, 11, 3, 0)
SCATTERED_DST = (1, 9, 4, 14, 6)
# One layer of 5 blocks is 1280 bytes here: messages never group two layers.
ONE_LAYER = replace(kp.FAST, max_message_bytes=2000)


def req(tid, peer, src, dst, deadline_s=10.0, layers=4):
    return TransferRequest(tid, peer, tuple(src), tuple(dst), layers, deadline_s)


@pytest.fixture
def pd():
    lay = kp.layout()
    p, d = kp.connector(lay, ONE_LAYER), kp.connector(lay, ONE_LAYER)
    kp.pair_up(p, "P", d, "D")
    yield p, d
    p.close()
    d.close()


@pytest.fixture
def copies(monkeypatch):
    """Counts of staging gathers (sender) and scatters (receiver) in this process."""
    counts = {"gather": 0, "scatter": 0}
    gather, scatter = Staging.gather, Staging.scatter

    def counted_gather(self, *args, **kwargs):
        counts["gather"] += 1
        return gather(self, *args, **kwargs)

    def counted_scatter(self, *args, **kwargs):
        counts["scatter"] += 1
        return scatter(self, *args, **kwargs)

    monkeypatch.setattr(Staging, "gather", counted_gather)
    monkeypatch.setattr(Staging, "scatter", counted_scatter)
    return counts


def test_run_is_found_only_for_one_ascending_run():
    lay = kp.layout()
    table = TransferTable(lay, lambda rec: None)
    kv = kp.cache(lay, 16, seed=None)
    cases = {
        (3, 4, 5): slice(3, 6),
        (8,): slice(8, 9),
        (5, 4, 3): None,  # descending: not one slice
        (3, 4, 6): None,
        (0, 2, 4): None,
    }
    for i, (ids, run) in enumerate(cases.items()):
        rec = table.add(req(f"r{i}", "X", ids, ids), Role.RECV, kv)
        assert rec.run == run, ids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("src", [RUN_SRC, SCATTERED_SRC], ids=["src-run", "src-scattered"])
@pytest.mark.parametrize("dst", [RUN_DST, SCATTERED_DST], ids=["dst-run", "dst-scattered"])
def test_bit_exact_in_every_mix_of_contiguous_and_scattered(pd, copies, src, dst):
    p, d = pd
    lay = p.layout
    src_kv, dst_kv = kp.cache(lay, 16, seed=11), kp.cache(lay, 16, seed=None)
    d.start_recv(req("t", "P", src, dst), dst_kv)
    send_all_layers(p, req("t", "D", src, dst), src_kv)
    assert d.wait("t", 20) is TransferStatus.DONE and p.wait("t", 20) is TransferStatus.DONE
    kp.assert_blocks_equal(src_kv, dst_kv, src, dst)
    untouched = [b for b in range(16) if b not in dst]
    assert all(torch.count_nonzero(t[untouched]) == 0 for t in dst_kv.layers)
    # A run side copies nothing; a scattered side copies every layer.
    assert copies["gather"] == (0 if src == RUN_SRC else lay.num_layers)
    assert copies["scatter"] == (0 if dst == RUN_DST else lay.num_layers)
    assert p.stats().bytes_sent == d.stats().bytes_received == lay.bytes_for_blocks(len(src))
    for conn in (p, d):
        conn.release("t")
        assert conn.num_records() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("src", [RUN_SRC, SCATTERED_SRC], ids=["src-run", "src-scattered"])
@pytest.mark.parametrize("dst", [RUN_DST, SCATTERED_DST], ids=["dst-run", "dst-scattered"])
def test_grouped_layers_and_streamed_layers_mix(src, dst):
    """Queued layers of small blocks travel grouped and gathered (FAST: two per message); a
    receiver with a run lands those through staging and single layers directly."""
    lay = kp.layout(num_layers=6)
    p, d = kp.connector(lay), kp.connector(lay)
    kp.pair_up(p, "P", d, "D")
    try:
        src_kv, dst_kv = kp.cache(lay, 16, seed=12), kp.cache(lay, 16, seed=None)
        d.start_recv(req("g", "P", src, dst, layers=6), dst_kv)
        p.start_send(req("g", "D", src, dst, layers=6), src_kv)
        p.send_layer("g", 5)  # alone
        assert _until(lambda: d.result("g") is not None or _layers(d, "g") >= 1)
        for layer in range(5):  # queued together: grouped
            p.send_layer("g", layer)
        assert d.wait("g", 20) is TransferStatus.DONE and p.wait("g", 20) is TransferStatus.DONE
        kp.assert_blocks_equal(src_kv, dst_kv, src, dst)
    finally:
        p.close()
        d.close()


def _layers(conn, tid: str) -> int:
    return conn._table.get(tid).layers_done


def _until(cond, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _pair(conn, peer: str) -> Pair:
    pair = conn._pair(peer)
    assert pair is not None
    return pair


def _in_cache(buf: torch.Tensor, kv: KVCache) -> bool:
    ptr = buf.data_ptr()
    return any(t.data_ptr() <= ptr < t.data_ptr() + t.numel() * t.element_size() for t in kv.layers)


def _hold_data_sends(pair: Pair, release: threading.Event) -> None:
    """The sender posts each LAYER header at once and its data only once `release` is set."""
    post = pair.post

    def held(staging, messages):
        works = post(staging, messages[:1])
        if len(messages) > 1:
            release.wait(10)
            works += post(staging, messages[1:])
        return works

    pair.post = held  # type: ignore[method-assign]


def _watch_recvs_into(pair: Pair, kv: KVCache) -> threading.Event:
    """Set once the receiver posts a recv straight into `kv`."""
    posted = threading.Event()
    post_recv = pair.post_recv

    def watched(staging, buf, tag):
        work = post_recv(staging, buf, tag)
        if tag != HEADER_TAG and _in_cache(buf, kv):
            posted.set()
        return work

    pair.post_recv = watched  # type: ignore[method-assign]
    return posted


def _blocked(call, *args) -> threading.Thread:
    """Start `call(*args)` on a thread and check it is still waiting a moment later."""
    t = threading.Thread(target=call, args=args, daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive(), f"{call.__name__} returned while the message was on the wire"
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["abort", "deadline", "broken pair"])
def test_receive_ended_during_a_direct_recv_never_writes_after_failed(pd, end):
    """A layer's data is on its way straight into the destination blocks when the receive is
    aborted (or its deadline passes, or the pair breaks): the receive ends only once the data
    is in, and once FAILED is visible the blocks never change again."""
    p, d = pd
    lay = p.layout
    src_kv, dst_kv = kp.cache(lay, 16, seed=21), kp.cache(lay, 16, seed=None)
    release = threading.Event()
    _hold_data_sends(_pair(p, "D"), release)
    posted = _watch_recvs_into(_pair(d, "P"), dst_kv)
    deadline_s = 0.3 if end == "deadline" else 10.0
    d.start_recv(req("x", "P", RUN_SRC, RUN_DST, deadline_s), dst_kv)
    p.start_send(req("x", "D", RUN_SRC, RUN_DST, deadline_s), src_kv)
    p.send_layer("x", 0)
    assert posted.wait(5), "no direct recv was posted"
    if end == "abort":
        ender = _blocked(d.abort, "x")
        assert not d.poll("x").finished
        release.set()
        ender.join(10)
        assert not ender.is_alive() and d.poll("x") is TransferStatus.FAILED
    elif end == "deadline":
        time.sleep(deadline_s + 0.1)
        assert not d.poll("x").finished  # past the deadline, but the data is on its way
        release.set()
        assert d.wait("x", 5) is TransferStatus.FAILED
        assert d.result("x").reason is FailureReason.TIMEOUT  # type: ignore[union-attr]
    else:
        _pair(d, "P").break_("broken by the test")  # as a lane thread would: without waiting
        assert not d.poll("x").finished
        release.set()
        assert d.wait("x", 5) is TransferStatus.FAILED
        assert d.result("x").reason is FailureReason.PEER_DEAD  # type: ignore[union-attr]
    seen = [t.clone() for t in dst_kv.layers]
    # The data that was on the wire is in; nothing else was written.
    assert torch.equal(dst_kv.layers[0][list(RUN_DST)], src_kv.layers[0][list(RUN_SRC)])
    assert all(torch.count_nonzero(t) == 0 for t in dst_kv.layers[1:])
    # The sender hears of it; layers it announces later are dropped, and the blocks stay put.
    for layer in range(1, lay.num_layers):
        p.send_layer("x", layer)
    assert p.wait("x", 5) is TransferStatus.FAILED
    if end == "abort":  # told while its sender thread held the send's io_lock: applied on release
        assert p.result("x").reason is FailureReason.PEER_ABORTED  # type: ignore[union-attr]
    time.sleep(0.3)
    assert all(torch.equal(a, b) for a, b in zip(seen, dst_kv.layers))
    del _pair(p, "D").post
    if end == "broken pair":
        _release_all(p, d)
    else:
        _still_in_step(p, d)


@pytest.mark.timeout(60)
def test_send_aborted_during_a_direct_send_has_read_its_blocks_when_abort_returns(pd):
    """abort() on the sender returns only once the wire is done reading the source blocks: the
    owner may then overwrite them without the receiver ever seeing it."""
    p, d = pd
    lay = p.layout
    src_kv, dst_kv = kp.cache(lay, 16, seed=31), kp.cache(lay, 16, seed=None)
    want = src_kv.layers[0][list(RUN_SRC)].clone()
    sent = threading.Event()
    send_pair = _pair(p, "D")
    post = send_pair.post

    def watched(staging, messages):
        works = post(staging, messages)
        if any(_in_cache(t, src_kv) for t, _ in messages):
            sent.set()
        return works

    send_pair.post = watched  # type: ignore[method-assign]
    # The receiver posts its data recvs only once released: the send stays on the wire.
    release = threading.Event()
    recv_pair = _pair(d, "P")
    post_recv = recv_pair.post_recv

    def held(staging, buf, tag):
        if tag != HEADER_TAG:
            release.wait(10)
        return post_recv(staging, buf, tag)

    recv_pair.post_recv = held  # type: ignore[method-assign]
    d.start_recv(req("s", "P", RUN_SRC, RUN_DST), dst_kv)
    p.start_send(req("s", "D", RUN_SRC, RUN_DST), src_kv)
    p.send_layer("s", 0)
    assert sent.wait(5), "no direct send was posted"
    ender = _blocked(p.abort, "s")
    release.set()
    ender.join(10)
    assert not ender.is_alive() and p.poll("s") is TransferStatus.FAILED
    for t in src_kv.layers:  # the owner frees the blocks and they are written at once
        t.fill_(-1.0)
    assert d.wait("s", 10) is TransferStatus.FAILED
    assert d.result("s").reason is FailureReason.PEER_ABORTED  # type: ignore[union-attr]
    assert torch.equal(dst_kv.layers[0][list(RUN_DST)], want)
    del send_pair.post, recv_pair.post_recv
    _still_in_step(p, d)


def _still_in_step(p, d) -> None:
    """A full transfer still goes through bit for bit, and every record is released."""
    lay = p.layout
    src_kv, dst_kv = kp.cache(lay, 16, seed=41), kp.cache(lay, 16, seed=None)
    d.start_recv(req("after", "P", RUN_SRC, RUN_DST), dst_kv)
    send_all_layers(p, req("after", "D", RUN_SRC, RUN_DST), src_kv)
    assert d.wait("after", 10) is TransferStatus.DONE
    assert p.wait("after", 10) is TransferStatus.DONE
    kp.assert_blocks_equal(src_kv, dst_kv, RUN_SRC, RUN_DST)
    _release_all(p, d)


def _release_all(*conns) -> None:
    for conn in conns:
        for tid in list(conn._table._records):
            assert conn.wait(tid, 10).finished
            conn.release(tid)
        assert conn.num_records() == 0
