"""KV transfer bandwidth: the connector against raw send/recv between the same two processes.

    python -m kv_transfer.bench [--json FILE] [--backend gloo|nccl] [--checksum on|off|both]

Two processes on 127.0.0.1 hold caches of the default model's layout (SmolLM2-135M: 30 layers,
3 KV heads, head_dim 64, block 16, float32; no weights are loaded). For 1, 16 and 256 blocks it
times a whole transfer through the connector (start on the sender until it sees DONE, which needs
the receiver's ACK) and a raw send of one contiguous tensor of the same bytes followed by a
one-element ack back, and reports medians. Transfers run twice per size: with contiguous ids on
both sides (fresh block pools hand out 0, 1, 2, ...; the connector then sends from and receives
into the cache itself) and with scattered ids (a random permutation; gathered and scattered
through staging). Then the layer-wise overlap, for both kinds of ids: a producer that "computes"
each layer in t ms (a sleep, as a GPU would leave the CPU free), with t set so compute and
transfer take about as long, sends after all layers (serial) or after each (overlapped).
`--checksum both` runs everything twice, without and with the per-message checksum, and prints
what it costs (on/off) side by side.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from engine.kv_cache import KVCache, KVCacheSpec
from engine.provenance import provenance, write_json
from kv_transfer.base import TransferRequest, TransferStatus, send_all_layers
from kv_transfer.layout import KVLayout
from kv_transfer.rendezvous import connect_lanes, join, listen
from kv_transfer.torch_dist import MAX_MESSAGE_BYTES, TorchDistConfig, TorchDistConnector

LAYOUT = KVLayout("smollm2-135m", 30, 3, 64, 16, "float32")
CACHE_BLOCKS = 320
SIZES = (1, 16, 256)
IDS = ("contiguous", "scattered")
REPS = {1: 30, 16: 15, 256: 7}
OVERLAP_REPS = 5
HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class BenchRow:
    blocks: int
    bytes: int
    gb_s: float
    raw_gb_s: float
    ratio: float
    ids: str  # "contiguous" or "scattered", on both sides


@dataclass(frozen=True, slots=True)
class OverlapFigure:
    ids: str
    layer_ms: float
    serial_s: float
    overlapped_s: float
    ratio: float


def _cache(device: torch.device, seed: int) -> KVCache:
    spec = KVCacheSpec(30, 3, 64, 16, torch.float32)
    kv = KVCache(spec, CACHE_BLOCKS, device)
    g = torch.Generator().manual_seed(seed)
    for t in kv.layers:
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def _block_ids(ids: str, n: int, seed: int) -> tuple[int, ...]:
    if ids == "contiguous":
        return tuple(range(n))
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(CACHE_BLOCKS, generator=g)[:n].tolist())


def _worker(rank: int, config: TorchDistConfig, ctrl: Any, barrier: Any, results: Any) -> None:
    """rank 0 sends (and hosts both rendezvous), rank 1 receives."""
    torch.set_num_threads(1)
    backend = config.backend
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn = TorchDistConnector(LAYOUT, device, config)
    peer = "D" if rank == 0 else "P"
    if rank == 0:
        address = conn.listen(peer)
        raw_store, raw_address = listen(HOST, 60)
        ctrl.put((address, raw_address))
    else:
        address, raw_address = ctrl.get(timeout=60)
        raw_store = join(raw_address, 60)
    conn.connect(peer, address, is_master=rank == 0)
    lanes = connect_lanes(raw_store, rank, backend, HOST, 60)
    raw = lanes.out if rank == 0 else lanes.inn  # lane 0 carries both directions here
    kv = _cache(device, seed=rank)
    rows = []
    for n in SIZES:
        # Allocated and touched once, like the connector's reused staging buffers.
        data = torch.ones(LAYOUT.bytes_for_blocks(n) // 4, dtype=torch.float32, device=device)
        conn_s: dict[str, list[float]] = {ids: [] for ids in IDS}
        raw_s = []
        # Alternated, so that a noisy neighbour slows all alike; rep 0 warms up and is dropped.
        for k in range(REPS[n] + 1):
            for ids in IDS:
                conn_s[ids].append(_one(conn, rank, peer, kv, ids, n, k, barrier, None))
                raw_s.append(_raw_once(raw, rank, data, barrier))
        if rank == 0:
            nbytes = LAYOUT.bytes_for_blocks(n)
            raw_gb = nbytes / statistics.median(raw_s[len(IDS) :]) / 1e9
            for ids in IDS:
                gb = nbytes / statistics.median(conn_s[ids][1:]) / 1e9
                rows.append(
                    BenchRow(n, nbytes, round(gb, 3), round(raw_gb, 3), round(gb / raw_gb, 3), ids)
                )
    figs = []
    for ids in IDS:
        # Compute per layer such that all layers' compute takes as long as the largest transfer.
        big = [r for r in rows if r.ids == ids and r.blocks == SIZES[-1]]
        layer_s = big[0].bytes / (big[0].gb_s * 1e9) / LAYOUT.num_layers if rank == 0 else 0.0
        serial, overlap = [], []
        for k in range(OVERLAP_REPS):
            serial.append(_one(conn, rank, peer, kv, ids, SIZES[-1], k, barrier, (layer_s, False)))
            overlap.append(_one(conn, rank, peer, kv, ids, SIZES[-1], k, barrier, (layer_s, True)))
        if rank == 0:
            s, o = statistics.median(serial), statistics.median(overlap)
            figs.append(
                OverlapFigure(
                    ids, round(layer_s * 1000, 3), round(s, 4), round(o, 4), round(o / s, 3)
                )
            )
    if rank == 0:
        results.put((rows, figs, conn.stats().failed))
    barrier.wait()
    conn.close()


def _one(
    conn: TorchDistConnector,
    rank: int,
    peer: str,
    kv: KVCache,
    ids: str,
    n: int,
    k: int,
    barrier: Any,
    compute: tuple[float, bool] | None,
) -> float:
    """One transfer of `n` blocks; returns the sender's seconds (0 on the receiver).
    `compute` = (seconds per layer, overlapped) simulates the producer."""
    mode = "bulk" if compute is None else ("overlapped" if compute[1] else "serial")
    tid = f"{mode}-{ids}-{n}-{k}"
    src, dst = _block_ids(ids, n, k), _block_ids(ids, n, 1000 + k)
    req = TransferRequest(tid, peer, src, dst, LAYOUT.num_layers, 60.0)
    barrier.wait()
    if rank == 1:
        conn.start_recv(req, kv)
        barrier.wait()
        status = conn.wait(tid, 60)
        conn.release(tid)
        assert status is TransferStatus.DONE, status
        return 0.0
    barrier.wait()
    t0 = time.perf_counter()
    if compute is None:
        send_all_layers(conn, req, kv)
    elif compute[1]:
        conn.start_send(req, kv)
        for layer in range(LAYOUT.num_layers):
            time.sleep(compute[0])
            conn.send_layer(tid, layer)
    else:
        time.sleep(compute[0] * LAYOUT.num_layers)
        send_all_layers(conn, req, kv)
    status = conn.wait(tid, 60)
    elapsed = time.perf_counter() - t0
    conn.release(tid)
    assert status is TransferStatus.DONE, status
    return elapsed


def _raw_once(pg: Any, rank: int, data: torch.Tensor, barrier: Any) -> float:
    """One contiguous message of `data`'s bytes and a one-element ack back."""
    device = data.device
    ack = torch.zeros(1, device=device)
    timeout = timedelta(seconds=60)
    barrier.wait()
    t0 = time.perf_counter()
    if rank == 0:
        pg.send([data], 1, 7).wait(timeout)
        pg.recv([ack], 1, 8).wait(timeout)
    else:
        pg.recv([data], 0, 7).wait(timeout)
        pg.send([ack], 0, 8).wait(timeout)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def run(config: TorchDistConfig) -> tuple[list[BenchRow], list[OverlapFigure]]:
    ctx = mp.get_context("spawn")
    # A peer that died breaks the barrier within its timeout rather than holding the other.
    ctrl, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2, timeout=120)
    procs = [
        ctx.Process(target=_worker, args=(r, config, ctrl, barrier, results), daemon=True)
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        rows, figs, failed = _result(results, procs, 300.0)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if failed:
        raise RuntimeError(f"{failed} transfers failed during the bench")
    return rows, figs


def _result(results: Any, procs: list[Any], timeout_s: float) -> Any:
    """Rank 0's figures, or an error as soon as a process has failed (its peer's barrier then
    breaks too) or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a bench process exited with {failed[0]}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no figures within {timeout_s:.0f} s") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kv_transfer.bench", description=__doc__)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument(
        "--max-message-mib",
        type=float,
        default=MAX_MESSAGE_BYTES / 2**20,
        help="the connector's cap on one message when it groups queued layers",
    )
    ap.add_argument(
        "--checksum",
        choices=("on", "off", "both"),
        default="on",
        help="per-message checksums (on: the default for CPU caches); both: compare",
    )
    args = ap.parse_args(argv)
    made = provenance()  # at the start: when it started, from which checkout
    t0 = time.perf_counter()
    config = TorchDistConfig(
        bind_host=HOST,
        backend=args.backend,
        max_message_bytes=int(args.max_message_mib * 2**20),
        checksum=args.checksum != "off",
    )
    off: list[BenchRow] = []
    if args.checksum == "both":
        off, _ = run(replace(config, checksum=False))
    rows, figs = run(config)
    print(f"backend {args.backend}, layout {LAYOUT}")
    print(f"{'ids':>10} {'blocks':>7} {'MB':>9} {'GB/s':>8} {'raw GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r.ids:>10} {r.blocks:>7} {r.bytes / 1e6:>9.2f} {r.gb_s:>8.3f} {r.raw_gb_s:>9.3f}"
            f" {r.ratio:>6.2f}"
        )
    for fig in figs:
        print(
            f"layer-wise overlap, {fig.ids} ids, {SIZES[-1]} blocks, {fig.layer_ms:.2f} ms compute"
            f" per layer: serial {fig.serial_s * 1000:.1f} ms, overlapped"
            f" {fig.overlapped_s * 1000:.1f} ms, ratio {fig.ratio:.2f} (target <= 0.6)"
        )
    if off:
        print("checksum cost: GB/s with checksums / without, same sizes, same run")
        print(f"{'ids':>10} {'blocks':>7} {'off GB/s':>9} {'on GB/s':>8} {'on/off':>7}")
        for a, b in zip(off, rows):
            print(
                f"{b.ids:>10} {b.blocks:>7} {a.gb_s:>9.3f} {b.gb_s:>8.3f} {b.gb_s / a.gb_s:>7.2f}"
            )
    print(f"bench took {time.perf_counter() - t0:.1f} s")
    if args.json:
        out = {
            "backend": args.backend,
            "checksum": args.checksum != "off",
            "rows": [asdict(r) for r in rows],
            "overlap": [asdict(f) for f in figs],
        }
        if off:
            out["rows_without_checksum"] = [asdict(r) for r in off]
        write_json(args.json, out, made)


if __name__ == "__main__":
    main()
