"""KV transfer: layout handshake, the fake connector's semantics, and the torch.distributed
connector over gloo on 127.0.0.1 with both ends in this process (peer processes:
test_kv_transfer_peers.py)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer.base import FailureReason, TransferRequest, TransferStatus, send_all_layers
from kv_transfer.fake import FakeHub
from kv_transfer.layout import KVLayout, LayoutMismatchError, check_compatible
from kv_transfer.rendezvous import choose_backend, device_identity, is_mig, pair_backend
from kv_transfer.torch_dist import StalePairing, TorchDistConnector
from tests import kv_peers as kp

SRC = (7, 2, 11, 3, 0)  # non-contiguous, unordered
DST = (1, 9, 4, 14, 6)


def req(tid: str, peer: str, deadline_s: float = 10.0, layers: int = 4, src=SRC, dst=DST):
    return TransferRequest(tid, peer, tuple(src), tuple(dst), layers, deadline_s)


def wait_all(conn, tids, timeout_s: float = 20.0) -> list[TransferStatus]:
    return [conn.wait(t, timeout_s) for t in tids]


# ---- layout ----


def test_layout_from_spec_and_sizes():
    spec = KVCacheSpec(30, 3, 64, 16, torch.float32)
    lay = KVLayout.from_spec(spec, "smollm2-135m@abc")
    assert lay.dtype == "float32" and lay.matches_spec(spec)
    assert lay.bytes_per_block_layer == 2 * 16 * 3 * 64 * 4
    assert lay.bytes_for_blocks(10) == 10 * spec.bytes_per_block
    assert KVLayout.from_json(lay.to_json()) == lay


def test_layout_mismatch_names_each_field():
    a = kp.layout()
    b = KVLayout("other@x", 4, 3, 8, 4, "float16")
    with pytest.raises(LayoutMismatchError) as err:
        check_compatible(a, b)
    assert set(err.value.fields) == {"model", "num_kv_heads", "dtype"}
    msg = str(err.value)
    assert "num_kv_heads: local=2 remote=3" in msg and "dtype: local='float32'" in msg


# ---- fake connector ----


def fake_pair(lay=None):
    lay = lay or kp.layout()
    hub = FakeHub()
    return hub, hub.connector("P", lay), hub.connector("D", lay)


def test_fake_roundtrip_and_early_layers():
    hub, p, d = fake_pair()
    src, dst = kp.cache(p.layout, 16, seed=1), kp.cache(d.layout, 16, seed=None)
    p.start_send(req("t", "D"), src)
    p.send_layer("t", 2)  # before the receiver registers: held in its inbox
    d.start_recv(req("t", "P"), dst)
    assert d.poll("t") is TransferStatus.TRANSFERRING
    for layer in (0, 3, 1):
        p.send_layer("t", layer)
    assert p.poll("t") is d.poll("t") is TransferStatus.DONE
    kp.assert_blocks_equal(src, dst, SRC, DST)
    res = d.result("t")
    assert res is not None and res.bytes == d.layout.bytes_for_blocks(len(SRC))
    assert p.stats().ok == 1 and d.stats().bytes_received == res.bytes
    d.release("t")
    with pytest.raises(KeyError):
        d.poll("t")


def test_fake_stall_ends_failed_at_deadline_and_blocks_untouched():
    hub, p, d = fake_pair()
    src, dst = kp.cache(p.layout, 16, seed=1), kp.cache(d.layout, 16, seed=None)
    d.start_recv(req("t", "P", deadline_s=0.2), dst)
    p.start_send(req("t", "D", deadline_s=0.2), src)
    p.send_layer("t", 0)
    p.stall()
    p.send_layer("t", 1)
    assert d.poll("t") is TransferStatus.TRANSFERRING
    assert d.wait("t", 5) is TransferStatus.FAILED
    assert p.wait("t", 5) is TransferStatus.FAILED
    res = d.result("t")
    assert res is not None and res.reason is FailureReason.TIMEOUT and res.error
    p.stall(False)
    p.send_layer("t", 2)  # after FAILED: ignored, the receiver's blocks stay as they were
    assert torch.count_nonzero(dst.layers[2]) == 0


def test_fake_injected_failure_and_abort_reach_the_peer():
    hub, p, d = fake_pair()
    src, dst = kp.cache(p.layout, 16, seed=1), kp.cache(d.layout, 16, seed=None)
    p.fail_next_send(after_layers=1)
    d.start_recv(req("a", "P"), dst)
    send_all_layers(p, req("a", "D"), src)
    assert p.result("a").reason is FailureReason.ERROR  # type: ignore[union-attr]
    assert d.result("a").reason is FailureReason.PEER_ABORTED  # type: ignore[union-attr]

    d.start_recv(req("b", "P"), dst)
    p.start_send(req("b", "D"), src)
    with pytest.raises(RuntimeError):
        p.release("b")  # still running: ownership is not handed back yet
    d.abort("b")
    assert d.poll("b") is TransferStatus.FAILED and p.poll("b") is TransferStatus.FAILED
    assert p.result("b").reason is FailureReason.PEER_ABORTED  # type: ignore[union-attr]
    p.release("b")


def test_fake_peer_death_and_layout_refusal():
    hub, p, d = fake_pair()
    src, dst = kp.cache(p.layout, 16, seed=1), kp.cache(d.layout, 16, seed=None)
    d.start_recv(req("t", "P"), dst)
    p.start_send(req("t", "D"), src)
    hub.kill("P")
    assert d.result("t").reason is FailureReason.PEER_DEAD  # type: ignore[union-attr]
    other = hub.connector("Q", KVLayout("tiny@test", 4, 2, 8, 8, "float32"))
    with pytest.raises(LayoutMismatchError, match="block_size"):
        other.start_send(req("u", "D"), src)


# ---- torch.distributed connector, both ends in this process ----


@pytest.fixture
def pd():
    lay = kp.layout()
    p, d = kp.connector(lay), kp.connector(lay)
    kp.pair_up(p, "P", d, "D")
    yield p, d
    p.close()
    d.close()


@pytest.mark.timeout(60)
def test_torch_dist_bit_exact_layer_streaming(pd):
    p, d = pd
    src, dst = kp.cache(p.layout, 16, seed=3), kp.cache(d.layout, 16, seed=None)
    d.start_recv(req("t", "P"), dst)
    p.start_send(req("t", "D"), src)
    for layer in (1, 0, 3, 2):  # any order, each once
        p.send_layer("t", layer)
    assert wait_all(d, ["t"]) == wait_all(p, ["t"]) == [TransferStatus.DONE]
    kp.assert_blocks_equal(src, dst, SRC, DST)
    untouched = [b for b in range(16) if b not in DST]
    assert all(torch.count_nonzero(t[untouched]) == 0 for t in dst.layers)
    nbytes = p.layout.bytes_for_blocks(len(SRC))
    assert p.stats().bytes_sent == d.stats().bytes_received == nbytes
    with pytest.raises(ValueError, match="twice"):
        p.send_layer("t", 0)
    # All layers queued at once travel in groups of consecutive layers (two per message here).
    again = kp.cache(d.layout, 16, seed=None)
    d.start_recv(req("g", "P"), again)
    send_all_layers(p, req("g", "D"), src)
    assert d.wait("g", 20) is p.wait("g", 20) is TransferStatus.DONE
    kp.assert_blocks_equal(src, again, SRC, DST)


@pytest.mark.timeout(60)
def test_torch_dist_layout_mismatch_refused():
    a = kp.connector(kp.layout())
    b = kp.connector(kp.layout(heads=4))
    with pytest.raises(LayoutMismatchError, match="num_kv_heads: local=2 remote=4"):
        kp.pair_up(a, "A", b, "B")
    assert not a.connected("B") and not b.connected("A")


@pytest.mark.timeout(90)
def test_torch_dist_concurrent_both_directions_and_2x2_pairs():
    lay = kp.layout()
    names = ["P0", "P1", "D0", "D1"]
    conns = {n: kp.connector(lay) for n in names}
    caches = {n: kp.cache(lay, 64, seed=i + 10) for i, n in enumerate(names)}
    for pn in ("P0", "P1"):
        for dn in ("D0", "D1"):
            kp.pair_up(conns[pn], pn, conns[dn], dn)
    jobs = []  # (sender, receiver, tid, src ids, dst ids): both directions on every pairing
    for i, (a, b) in enumerate([(s, r) for s in names for r in names if s[0] != r[0]]):
        for k in range(3):
            src = tuple(range(i * 3 + k, 64, 16))[:3]
            dst = tuple(range(63 - i * 3 - k, -1, -16))[:3]
            jobs.append((a, b, f"{a}>{b}#{k}", src, dst))
    dsts = {n: kp.cache(lay, 64, seed=None) for n in names}
    for a, b, tid, src, dst in jobs:
        conns[b].start_recv(req(tid, a, 30, src=src, dst=dst), dsts[b])

    def produce(a: str) -> None:
        mine = [j for j in jobs if j[0] == a]
        for _, b, tid, src, dst in mine:
            conns[a].start_send(req(tid, b, 30, src=src, dst=dst), caches[a])
        for layer in range(lay.num_layers):  # layer-major, as a batched prefill would
            for _, _, tid, _, _ in mine:
                conns[a].send_layer(tid, layer)

    threads = [threading.Thread(target=produce, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for a, b, tid, src, dst in jobs:
        assert conns[b].wait(tid, 30) is TransferStatus.DONE, conns[b].result(tid)
        assert conns[a].wait(tid, 30) is TransferStatus.DONE, conns[a].result(tid)
        for layer in range(lay.num_layers):
            assert torch.equal(dsts[b].layers[layer][list(dst)], caches[a].layers[layer][list(src)])
    for c in conns.values():
        c.close()


def _transfer_goes_through(p: TorchDistConnector, d: TorchDistConnector, tid: str) -> None:
    src, dst = kp.cache(p.layout, 16, seed=7), kp.cache(d.layout, 16, seed=None)
    d.start_recv(req(tid, "P"), dst)
    send_all_layers(p, req(tid, "D"), src)
    assert d.wait(tid, 10) is TransferStatus.DONE and p.wait(tid, 10) is TransferStatus.DONE
    kp.assert_blocks_equal(src, dst, SRC, DST)


@pytest.mark.timeout(60)
def test_torch_dist_abort_and_timeout_leave_the_pair_usable(pd):
    p, d = pd
    src, dst = kp.cache(p.layout, 16, seed=5), kp.cache(d.layout, 16, seed=None)
    # The receiver aborts mid-transfer: the sender hears of it.
    d.start_recv(req("a", "P"), dst)
    p.start_send(req("a", "D"), src)
    p.send_layer("a", 0)
    deadline = time.monotonic() + 5
    while d.poll("a") is TransferStatus.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    d.abort("a")
    assert d.result("a").reason is FailureReason.ABORTED  # type: ignore[union-attr]
    assert p.wait("a", 5) is TransferStatus.FAILED
    assert p.result("a").reason is FailureReason.PEER_ABORTED  # type: ignore[union-attr]
    p.send_layer("a", 1)  # after the end: ignored
    # The sender aborts: the receiver hears of it.
    d.start_recv(req("b", "P"), dst)
    p.start_send(req("b", "D"), src)
    p.abort("b")
    assert d.wait("b", 5) is TransferStatus.FAILED
    assert d.result("b").reason is FailureReason.PEER_ABORTED  # type: ignore[union-attr]
    # Layers never come: both sides end FAILED (TIMEOUT) at the deadline, not later.
    d.start_recv(req("c", "P", deadline_s=0.5), dst)
    p.start_send(req("c", "D", deadline_s=0.5), src)
    t0 = time.monotonic()
    assert d.wait("c", 5) is TransferStatus.FAILED and p.wait("c", 5) is TransferStatus.FAILED
    assert time.monotonic() - t0 < 1.5
    assert d.result("c").reason is FailureReason.TIMEOUT  # type: ignore[union-attr]
    # A send nobody registered for is refused after register_wait_s.
    p.start_send(req("d", "D"), src)
    assert p.wait("d", 10) is TransferStatus.FAILED
    # The lanes are still in step: a full transfer goes through, bit for bit.
    _transfer_goes_through(p, d, "e")
    assert p.stats().failed == 4 and d.stats().ok == 1


@pytest.mark.timeout(60)
def test_torch_dist_block_count_mismatch(pd):
    p, d = pd
    src, dst = kp.cache(p.layout, 16, seed=5), kp.cache(d.layout, 16, seed=None)
    d.start_recv(req("m", "P", src=SRC[:2], dst=DST[:2]), dst)
    send_all_layers(p, req("m", "D"), src)
    assert d.wait("m", 10) is TransferStatus.FAILED and p.wait("m", 10) is TransferStatus.FAILED
    assert d.result("m").reason is FailureReason.MISMATCH  # type: ignore[union-attr]
    assert torch.count_nonzero(dst.layers[0]) == 0


@pytest.mark.timeout(90)
def test_a_pairing_attempt_replaced_while_it_connects_cannot_undo_the_next():
    """A router gives up on attempt 1 while its connect is still running on the workers, and
    starts attempt 2 (disconnect, listen, connect, all numbered 2). Attempt 1's calls that end or
    arrive late neither install a pair nor close attempt 2's."""
    lay = kp.layout()
    p, d = kp.connector(lay), kp.connector(lay)
    try:
        with ThreadPoolExecutor(2) as pool:
            address = d.listen("P", 1)
            late_master = pool.submit(d.connect, "P", address, True, 1)  # waits for P
            time.sleep(0.2)
            assert not late_master.done()
            d.disconnect("P", 2)  # attempt 2 begins on D while attempt 1 still waits there
            # Attempt 1 completes its handshake late: D closes the pair it made, unused.
            late_peer = pool.submit(p.connect, "D", address, False, 1)
            with pytest.raises(StalePairing, match="attempt 1 with 'P' was replaced"):
                late_master.result(timeout=30)
            late_peer.result(timeout=30)  # P's end had no word of attempt 2 yet
            assert not d.connected("P")
            deadline = time.monotonic() + 10  # P's end hears the close
            while p.connected("D") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not p.connected("D")
            # Attempt 2 on P's end, then the pair.
            p.disconnect("D", 2)
            address = d.listen("P", 2)
            peer = pool.submit(p.connect, "D", address, False, 2)
            d.connect("P", address, True, 2)
            peer.result(timeout=30)
        # Attempt 1's calls that arrive now are refused, and its disconnect leaves the pair be.
        with pytest.raises(StalePairing):
            d.listen("P", 1)
        with pytest.raises(StalePairing):
            p.connect("D", address, False, 1)
        d.disconnect("P", 1)
        p.disconnect("D", 1)
        assert p.connected("D") and d.connected("P")
        _transfer_goes_through(p, d, "after")
    finally:
        p.close()
        d.close()


def test_disconnect_closes_a_rendezvous_nobody_joined():
    lay = kp.layout()
    d = kp.connector(lay)
    try:
        address = d.listen("P", 3)
        socket.create_connection((address.host, address.port), timeout=2).close()  # listening
        d.disconnect("P", 4)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address.host, address.port), timeout=2)
    finally:
        d.close()


def test_torch_dist_unconnected_peer_fails_at_once():
    lay = kp.layout()
    conn = TorchDistConnector(lay, "cpu", kp.FAST)
    conn.start_send(req("n", "nobody"), kp.cache(lay, 16, seed=1))
    assert conn.poll("n") is TransferStatus.FAILED
    assert conn.result("n").reason is FailureReason.PEER_DEAD  # type: ignore[union-attr]


def test_auto_backend_is_settled_per_pair_from_both_sides_devices():
    """auto: nccl only between two different GPUs; gloo where a cache is on CPU or both ends are
    on one GPU (workers given a fraction of a GPU each: NCCL refuses two ranks on one device)."""
    gpu_a, gpu_b = "cuda/GPU-aaaa", "cuda/GPU-bbbb"
    assert pair_backend("auto", gpu_a, gpu_b) == "nccl"
    assert pair_backend("auto", gpu_a, gpu_a) == "gloo"
    assert pair_backend("auto", "", gpu_a) == pair_backend("auto", gpu_a, "") == "gloo"
    assert pair_backend("auto", "", "") == "gloo"
    assert pair_backend("gloo", gpu_a, gpu_b) == "gloo"
    assert pair_backend("nccl", gpu_a, gpu_b) == "nccl"
    # nccl asked for where it cannot work: refused at pairing, not a failure per transfer
    with pytest.raises(ValueError, match="nccl backend needs the two caches on two GPUs.*one GPU"):
        pair_backend("nccl", gpu_a, gpu_a)
    with pytest.raises(ValueError, match="a cache is on CPU"):
        pair_backend("nccl", gpu_a, "")
    # MIG instances (slices of a GPU, each with its own UUID): NCCL does not support them.
    mig_a, mig_b = "cuda-mig/MIG-aaaa", "cuda-mig/MIG-bbbb"
    assert pair_backend("auto", mig_a, mig_b) == pair_backend("auto", gpu_a, mig_b) == "gloo"
    with pytest.raises(ValueError, match="a cache is on a MIG instance, which NCCL does not"):
        pair_backend("nccl", mig_a, mig_b)
    assert is_mig("NVIDIA A100-SXM4-40GB MIG 3g.20gb") and is_mig("NVIDIA H100 MIG 1g.10gb")
    assert not is_mig("NVIDIA H100 80GB HBM3") and not is_mig("NVIDIA A100-SXM4-80GB")
    assert device_identity(torch.device("cpu")) == ""
    assert choose_backend("auto", torch.device("cpu")) == "auto"
    with pytest.raises(ValueError, match="needs a CUDA cache"):
        choose_backend("nccl", torch.device("cpu"))


@pytest.mark.timeout(120)
def test_both_ends_of_a_pair_agree_on_the_backend_their_devices_call_for(monkeypatch):
    """The identities cross in the handshake, and each side's lanes are made with the backend
    `pair_backend` gives for the two: the same on both sides. (On CPU the lanes are then made with
    gloo whatever was chosen, and a transfer goes through to show the pair works.)"""
    import kv_transfer.torch_dist as td

    chosen: list[tuple[int, str]] = []
    real = td.connect_lanes

    def recording(store, rank, backend, bind_host, timeout_s):
        chosen.append((rank, backend))
        return real(store, rank, "gloo", bind_host, timeout_s)

    monkeypatch.setattr(td, "connect_lanes", recording)
    lay = kp.layout()
    cases = [("cuda/GPU-aaaa", "cuda/GPU-bbbb", "nccl"), ("cuda/GPU-aaaa", "cuda/GPU-aaaa", "gloo"),
             ("", "cuda/GPU-aaaa", "gloo"), ("", "", "gloo")]  # fmt: skip
    for i, (id_a, id_b, want) in enumerate(cases):
        a, b = kp.connector(lay), kp.connector(lay)
        a._device_id, b._device_id = id_a, id_b  # as device_identity gives on those devices
        chosen.clear()
        try:
            kp.pair_up(a, "A", b, "B")
            assert sorted(chosen) == [(0, want), (1, want)], (id_a, id_b)
            src, dst = kp.cache(lay, 8, seed=i + 1), kp.cache(lay, 8, seed=None)
            b.start_recv(req(f"t{i}", "A", 30, src=(1, 2), dst=(5, 6)), dst)
            send_all_layers(a, req(f"t{i}", "B", 30, src=(1, 2), dst=(5, 6)), src)
            assert b.wait(f"t{i}", 30) is TransferStatus.DONE
            assert a.wait(f"t{i}", 30) is TransferStatus.DONE
            kp.assert_blocks_equal(src, dst, (1, 2), (5, 6))
        finally:
            a.close()
            b.close()
