"""Helpers for the KV transfer tests: small layouts, seeded caches, in-process pairing, and the
bodies of peer processes (importable by name, as torch.multiprocessing spawn needs)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer.base import TransferRequest
from kv_transfer.layout import KVLayout
from kv_transfer.rendezvous import PeerAddress
from kv_transfer.torch_dist import TorchDistConfig, TorchDistConnector

# Small messages (two layers of a 5-block transfer) so that layer grouping is exercised.
FAST = TorchDistConfig(
    bind_host="127.0.0.1",  # both peers in this process
    connect_timeout_s=30.0,
    io_timeout_s=10.0,
    heartbeat_s=0.2,
    register_wait_s=2.0,
    max_message_bytes=6000,
)


def layout(num_layers: int = 4, heads: int = 2, head_dim: int = 8, block: int = 4) -> KVLayout:
    return KVLayout("tiny@test", num_layers, heads, head_dim, block, "float32")


def cache(lay: KVLayout, num_blocks: int, seed: int | None, device: str = "cpu") -> KVCache:
    """A cache of `num_blocks`; random values from `seed`, or zeros when seed is None."""
    spec = KVCacheSpec(
        lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, torch.float32
    )
    kv = KVCache(spec, num_blocks, torch.device(device))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in kv.layers:
            t.copy_(torch.randn(t.shape, generator=g))
    return kv


def connector(lay: KVLayout, config: TorchDistConfig = FAST) -> TorchDistConnector:
    return TorchDistConnector(lay, "cpu", config)


def pair_up(a: TorchDistConnector, a_id: str, b: TorchDistConnector, b_id: str) -> None:
    """Connect `a` (master, known to b as a_id) and `b` (known to a as b_id) in this process."""
    address = a.listen(b_id)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(b.connect, a_id, address, False)
        a.connect(b_id, address, True)
        fut.result(timeout=30)


def assert_blocks_equal(
    src: KVCache, dst: KVCache, src_ids: tuple[int, ...], dst_ids: tuple[int, ...]
) -> None:
    for layer, (s, d) in enumerate(zip(src.layers, dst.layers)):
        got, want = d[list(dst_ids)], s[list(src_ids)]
        assert torch.equal(got, want), f"layer {layer} differs"


# ---- peer process bodies ----


def sender_peer(
    address: PeerAddress,
    lay: KVLayout,
    num_blocks: int,
    seed: int,
    req: TransferRequest,
    layers: list[int],
    events: object,
) -> None:
    """Connect to the parent (as "parent"), send `req` announcing only `layers`, report the end
    status on `events` (a multiprocessing queue), then linger until killed or 60 s pass."""
    torch.set_num_threads(1)
    conn = connector(lay)
    conn.connect("parent", address, is_master=False)
    events.put("connected")  # type: ignore[attr-defined]
    kv = cache(lay, num_blocks, seed)
    conn.start_send(req, kv)
    for layer in layers:
        conn.send_layer(req.transfer_id, layer)
    if len(layers) == req.num_layers:
        events.put(conn.wait(req.transfer_id, req.deadline_s).value)  # type: ignore[attr-defined]
    end = time.monotonic() + 60
    while time.monotonic() < end and threading.main_thread().is_alive():
        time.sleep(0.1)
    conn.close()


def receiver_peer(
    address: PeerAddress, lay: KVLayout, num_blocks: int, req: TransferRequest, events: object
) -> None:
    """Connect to the parent, register `req` as a receive, report "registered", then linger
    (the parent kills this process mid-transfer)."""
    torch.set_num_threads(1)
    conn = connector(lay)
    conn.connect("parent", address, is_master=False)
    kv = cache(lay, num_blocks, None)
    conn.start_recv(req, kv)
    events.put("registered")  # type: ignore[attr-defined]
    time.sleep(60)
    conn.close()
