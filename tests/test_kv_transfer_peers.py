"""KV transfer between processes: bit-exact across a process boundary, and a peer killed
mid-transfer ends FAILED well within the deadline on both roles. Also the CUDA paths (gloo over
CUDA tensors on one GPU; NCCL across two), which run only where GPUs exist."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from kv_transfer.base import FailureReason, TransferRequest, TransferStatus, send_all_layers
from kv_transfer.torch_dist import TorchDistConnector
from tests import kv_peers as kp

SRC = (7, 2, 11, 3, 0)  # non-contiguous, unordered
DST = (1, 9, 4, 14, 6)


def req(tid: str, peer: str, deadline_s: float = 10.0, layers: int = 4) -> TransferRequest:
    return TransferRequest(tid, peer, SRC, DST, layers, deadline_s)


def spawn(target, *args):
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, events), daemon=True)
    proc.start()
    return proc, events


@pytest.mark.timeout(90)
def test_cross_process_bit_exact():
    lay = kp.layout(num_layers=6)
    conn = kp.connector(lay)
    r = req("x", "parent", 30, layers=6)
    address = conn.listen("child")
    proc, events = spawn(kp.sender_peer, address, lay, 16, 42, r, list(range(6)))
    try:
        conn.connect("child", address, is_master=True)
        dst = kp.cache(lay, 16, seed=None)
        conn.start_recv(req("x", "child", 30, layers=6), dst)
        assert conn.wait("x", 30) is TransferStatus.DONE
        assert events.get(timeout=30) == "connected"
        assert events.get(timeout=30) == "done"
        kp.assert_blocks_equal(kp.cache(lay, 16, seed=42), dst, SRC, DST)
    finally:
        proc.kill()
        proc.join(10)
        conn.close()


@pytest.mark.timeout(90)
def test_peer_killed_mid_transfer_fails_both_roles_before_deadline():
    lay = kp.layout()
    conn = kp.connector(lay)
    address = conn.listen("child")
    # The child sends two layers of four, then hangs; this side receives.
    proc, events = spawn(kp.sender_peer, address, lay, 16, 1, req("k", "parent", 30), [0, 1])
    try:
        conn.connect("child", address, is_master=True)
        conn.start_recv(req("k", "child", 30), kp.cache(lay, 16, seed=None))
        src = kp.cache(lay, 16, seed=2)
        send_all_layers(conn, req("back", "child", 30), src)  # nobody receives it there
        deadline = time.monotonic() + 20
        while conn._table.get("k").layers_done < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.kill()
        assert conn.wait("k", 30) is TransferStatus.FAILED
        assert conn.wait("back", 30) is TransferStatus.FAILED
        assert time.monotonic() - t0 < 10  # well inside the 30 s deadline
        assert conn.result("k").reason is FailureReason.PEER_DEAD  # type: ignore[union-attr]
        assert not conn.connected("child")
        # A new transfer to the dead peer fails at once instead of waiting.
        conn.start_recv(req("late", "child", 30), kp.cache(lay, 16, seed=None))
        assert conn.poll("late") is TransferStatus.FAILED
    finally:
        proc.kill()
        proc.join(10)
        conn.close()


@pytest.mark.timeout(90)
def test_receiver_killed_fails_the_sender():
    lay = kp.layout()
    conn = kp.connector(lay)
    address = conn.listen("child")
    proc, events = spawn(kp.receiver_peer, address, lay, 16, req("s", "parent", 30))
    try:
        conn.connect("child", address, is_master=True)
        assert events.get(timeout=30) == "registered"
        conn.start_send(req("s", "child", 30), kp.cache(lay, 16, seed=2))
        conn.send_layer("s", 0)
        proc.kill()
        t0 = time.monotonic()
        assert conn.wait("s", 30) is TransferStatus.FAILED
        assert time.monotonic() - t0 < 10
        assert conn.result("s").reason is FailureReason.PEER_DEAD  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.join(10)
        conn.close()


def _cuda_roundtrip(p: TorchDistConnector, d: TorchDistConnector, device_p: str, device_d: str):
    lay = p.layout
    src = kp.cache(lay, 16, seed=3, device=device_p)
    dst = kp.cache(lay, 16, seed=None, device=device_d)
    d.start_recv(req("c", "P"), dst)
    p.start_send(req("c", "D"), src)
    side = torch.cuda.Stream(device_p)
    side.wait_stream(torch.cuda.current_stream(device_p))
    for layer in range(lay.num_layers):  # the producer writes each layer on its own stream
        with torch.cuda.stream(side):
            src.layers[layer].mul_(2.0)
            p.send_layer("c", layer)
    assert d.wait("c", 30) is TransferStatus.DONE and p.wait("c", 30) is TransferStatus.DONE
    for s, t in zip(src.layers, dst.layers):
        assert torch.equal(t[list(DST)].cpu(), s[list(SRC)].cpu())


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_cache_over_gloo_on_one_device():
    """The default backend (auto) settles two caches on one GPU on gloo: NCCL refuses two ranks
    on one device."""
    p, d = (
        TorchDistConnector(kp.layout(), "cuda:0", kp.FAST),
        TorchDistConnector(kp.layout(), "cuda:0", kp.FAST),
    )
    kp.pair_up(p, "P", d, "D")
    try:
        assert p._pair("D").lanes.backend == d._pair("P").lanes.backend == "gloo"
        assert p._device_id == d._device_id and p._device_id.startswith("cuda/")
        assert len(p._device_id) > len("cuda/")  # the GPU's UUID
        _cuda_roundtrip(p, d, "cuda:0", "cuda:0")
    finally:
        p.close()
        d.close()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.timeout(120)
def test_nccl_across_two_devices():
    """The default backend (auto) settles caches on two GPUs on nccl."""
    p, d = (
        TorchDistConnector(kp.layout(), "cuda:0", kp.FAST),
        TorchDistConnector(kp.layout(), "cuda:1", kp.FAST),
    )
    kp.pair_up(p, "P", d, "D")
    try:
        assert p._pair("D").lanes.backend == d._pair("P").lanes.backend == "nccl"
        _cuda_roundtrip(p, d, "cuda:0", "cuda:1")
    finally:
        p.close()
        d.close()
