"""The torch.distributed KV connector: paged blocks over point-to-point send/recv, NCCL between
two GPUs and gloo otherwise (CPU caches; a CUDA cache through host memory where both ends share one
GPU or the other end is on CPU), with a process group per peer made on first contact.

Pairing (rendezvous.py): the master side calls `listen(peer_id)` and hands the returned
`PeerAddress` to the other side; both then call `connect(peer_id, address, is_master)` at the same
time. The two exchange `KVLayout`s through the pair's TCPStore and refuse a mismatch with
LayoutMismatchError naming the fields, before any process group exists. A pool grows by pairing
the new worker with the peers it needs; nobody else's groups are touched.

Attempts: a router numbers its pairing attempts (`attempt`, increasing) and passes the number to
every `listen`, `connect` and `disconnect` of one attempt. An attempt it gave up on may still be
running here, its calls arriving in any order after the next attempt's (a timed-out `connect`
blocked in its handshake, a call delayed in the actor's queue). A `disconnect(peer, n)` ends
every attempt before n: their later `listen`s and `connect`s raise StalePairing, and a `connect`
of theirs that completes after it closes the pair it made instead of installing it. So a late
call can neither take the new attempt's place nor close what it made.

Per layer, a transfer's source blocks are gathered (`index_select`) into one contiguous message;
the receiver lands it in a staging tensor and scatters it (`index_copy_`) into its destination
blocks. `send_layer(tid, i)` queues layer i, so it goes out while the producer computes layer i+1.
Layers of one transfer that are already queued when the sender thread gets to them travel as one
message (up to `max_message_bytes`): a complete KV goes out in a few large messages, and a
producer that outruns the wire is caught up in batches rather than one layer at a time.
Where a side's block ids are one ascending run (fresh allocations), a one-layer message needs no
copy on that side: it is sent from, or received into, the cache slice itself (staging.py; the
ownership rules that keep this safe are in sender.py, receiver.py and table.py).

Ordering rule (why concurrent transfers cannot deadlock):
  1. Each pair has two lanes (process groups), one per direction. On a lane, exactly one thread
     posts sends (the sender's LaneSender) and exactly one posts recvs (the peer's LaneReceiver).
  2. Every message is a header on tag 0; a LAYER header is followed by its data on the transfer's
     own tag `1 + seq` (seq: the per-lane sequence number the START header announced). The sender
     thread posts messages strictly in outbox order, each only after the previous one completed;
     the receiver reads a header, then, for LAYER, exactly that data message (on gloo it may
     already have posted the recv for the header after it: a different tag). So every send the
     sender posts meets a recv the receiver posts next, whatever the other lanes do: a lane never
     waits on anything but the other end's thread.
  3. The two directions share nothing on the wire, and threads of different pairs share only
     short locks never held across a wait. So no cycle of waits can form: not between the two
     directions of a pair, not across pairs, whatever the mix of concurrent transfers.
  4. The only wait that is not the wire's is a START waiting for its `start_recv` (bounded by
     `register_wait_s` and the transfer's deadline); every wire wait is bounded by `io_timeout_s`.
Failure: a transfer past its deadline (checked on poll/wait/result and every `heartbeat_s` on the
sender thread) or aborted ends FAILED and the peer is told (ABORT / PEER_FAIL), so its side ends
too. A lane error or silence past `io_timeout_s` (heartbeats flow while idle) breaks the pair:
all its running transfers end FAILED (PEER_DEAD). A recv from an exited process fails at once.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.kv_cache import KVCache
from kv_transfer.base import FailureReason, TransferRequest
from kv_transfer.faults import FaultInjector, FaultPlan
from kv_transfer.layout import KVLayout
from kv_transfer.pair import Pair, PairConfig
from kv_transfer.receiver import LaneReceiver
from kv_transfer.rendezvous import (
    PeerAddress,
    choose_backend,
    connect_lanes,
    device_identity,
    handshake,
    join,
    listen,
    pair_backend,
)
from kv_transfer.sender import LaneSender
from kv_transfer.table import Role, TrackedConnector, Transfer

# Connectors still open at interpreter exit are closed first (see close()).
_LIVE: weakref.WeakSet[TorchDistConnector] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for conn in list(_LIVE):
        conn.close()


MAX_MESSAGE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class TorchDistConfig:
    # The interface this worker's store and lanes listen on: the address its node is known by
    # (worker_protocol/address.py). No default: loopback would strand a peer on another node.
    bind_host: str
    # "auto" (per pair: nccl between two GPUs, else gloo; rendezvous.pair_backend), "gloo", "nccl"
    backend: str = "auto"
    connect_timeout_s: float = 60.0
    io_timeout_s: float = 30.0
    heartbeat_s: float = 1.0
    register_wait_s: float = 10.0
    # Layers already queued for one transfer travel as one message up to this size. Small enough
    # that a complete KV of a few MiB still splits into messages whose copies overlap the wire.
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # A checksum per LAYER message, checked by the receiver (a mismatch ends the transfer
    # CORRUPT). None: on for CPU caches, where it costs a pass over memory; off for CUDA ones.
    checksum: bool | None = None
    faults: FaultPlan | None = None  # tests and benches only: see faults.py

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.io_timeout_s:
            raise ValueError("need 0 < heartbeat_s < io_timeout_s")
        if not 0 <= self.register_wait_s < self.io_timeout_s:
            raise ValueError("need 0 <= register_wait_s < io_timeout_s")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {self.max_message_bytes}")


class StalePairing(RuntimeError):
    """A pairing call of an attempt that a newer one has replaced."""


class TorchDistConnector(TrackedConnector):
    def __init__(
        self,
        layout: KVLayout,
        device: torch.device | str,
        config: TorchDistConfig,
    ) -> None:
        super().__init__(layout)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        # "gloo", "nccl", or "auto": then each pair settles it (pair_backend)
        self.requested_backend = choose_backend(self.config.backend, self.device)
        self._device_id = device_identity(self.device)
        checksum = self.config.checksum
        self.checksum = self.device.type == "cpu" if checksum is None else checksum
        self.faults = FaultInjector(self.config.faults) if self.config.faults else None
        self._lock = threading.Lock()  # guards the fields below; never held across a wait
        self._pairs: dict[str, tuple[int, Pair]] = {}  # peer -> (attempt, pair)
        self._listening: dict[str, tuple[int, dist.TCPStore]] = {}
        # Per peer, attempts before this one are stale (raised by disconnect).
        self._floor: dict[str, int] = {}
        # A master's store must outlive the handshake: the peer may still be reading from it.
        # Kept per peer until the pair is replaced or disconnected.
        self._stores: dict[str, dist.Store] = {}
        # A closing peer answers CLOSE at once unless it is hung; then give up quickly.
        self._join_s = max(2.0, 2 * self.config.heartbeat_s)
        _LIVE.add(self)

    # ---- pairing ----

    def listen(self, peer_id: str, attempt: int = 0) -> PeerAddress:
        """Host the rendezvous for `peer_id` (this side will be master) and return its address."""
        store, address = listen(self.config.bind_host, self.config.connect_timeout_s)
        with self._lock:
            self._check_attempt(peer_id, attempt)
            self._listening[peer_id] = (attempt, store)
        return address

    def connect(
        self, peer_id: str, address: PeerAddress, is_master: bool, attempt: int = 0
    ) -> None:
        """Pair with `peer_id`; blocks until the peer has called connect too (or times out).
        Raises LayoutMismatchError when the layouts differ, StalePairing when a newer attempt
        has begun (see the module's docstring)."""
        timeout = self.config.connect_timeout_s
        with self._lock:
            self._check_attempt(peer_id, attempt)
            old = self._pairs.get(peer_id)
            if old is not None and old[1].alive:
                raise ValueError(f"already connected to {peer_id!r}")
            store: dist.Store | None = None
            if is_master:
                listening = self._listening.get(peer_id)
                if listening is not None and listening[0] == attempt:
                    store = self._listening.pop(peer_id)[1]
        if store is None:
            if is_master:
                raise ValueError(f"call listen({peer_id!r}) before connecting as master")
            store = join(address, timeout)
        rank = 0 if is_master else 1
        remote_device = handshake(store, rank, self.layout, self._device_id)
        backend = pair_backend(self.requested_backend, self._device_id, remote_device)
        lanes = connect_lanes(store, rank, backend, self.config.bind_host, timeout)
        cfg = self.config
        pair = Pair(
            peer_id,
            rank,
            lanes,
            self._table,
            self.layout,
            self.device,
            PairConfig(
                cfg.io_timeout_s,
                cfg.heartbeat_s,
                cfg.register_wait_s,
                cfg.max_message_bytes,
                self.checksum,
            ),
            self.faults,
        )
        pair.start({"send": LaneSender(pair).run, "recv": LaneReceiver(pair).run})
        with self._lock:
            old = self._pairs.get(peer_id)
            # Replaced meanwhile (a newer attempt's disconnect ran), or another connect of this
            # attempt got there first.
            stale = attempt < self._floor.get(peer_id, 0) or (old is not None and old[1].alive)
            if not stale:
                self._pairs[peer_id] = (attempt, pair)
                self._stores[peer_id] = store
        if stale:
            pair.close(join_s=self._join_s)
            raise StalePairing(f"pairing attempt {attempt} with {peer_id!r} was replaced")

    def _check_attempt(self, peer_id: str, attempt: int) -> None:
        floor = self._floor.get(peer_id, 0)
        if attempt < floor:
            raise StalePairing(
                f"pairing attempt {attempt} with {peer_id!r} was replaced by attempt {floor}"
            )

    def connected(self, peer_id: str) -> bool:
        pair = self._pair(peer_id)
        return pair is not None and pair.alive

    def disconnect(self, peer_id: str, attempt: int | None = None) -> None:
        """Fail this peer's running transfers (ABORTED) and close the pair. With `attempt`, also
        end every pairing attempt before it; a pair made by a newer attempt is left alone."""
        with self._lock:
            if attempt is not None:
                self._floor[peer_id] = max(self._floor.get(peer_id, 0), attempt)
            current = self._pairs.get(peer_id)
            if current is not None and attempt is not None and current[0] > attempt:
                return  # made by a newer attempt than this call knows of
            self._pairs.pop(peer_id, None)
            self._stores.pop(peer_id, None)
            listening = self._listening.get(peer_id)
            if listening is not None and (attempt is None or listening[0] < attempt):
                del self._listening[peer_id]  # its socket closes with the store
        for rec in self._table.running(peer_id):
            self._table.fail(rec, FailureReason.ABORTED, "disconnected from the peer")
        if current is not None:
            current[1].close(join_s=self._join_s)

    def _pair(self, peer_id: str) -> Pair | None:
        with self._lock:
            entry = self._pairs.get(peer_id)
        return None if entry is None else entry[1]

    # ---- transfers ----

    def _check_device(self, cache: KVCache) -> None:
        if cache.layers[0].device != self.device:
            raise ValueError(f"cache on {cache.layers[0].device}, connector on {self.device}")

    def start_send(self, req: TransferRequest, cache: KVCache) -> None:
        self._check_device(cache)
        rec = self._table.add(req, Role.SEND, cache)
        if self.faults is not None:
            self.faults.started(rec)
        pair = self._pair(req.peer)
        if pair is None or not pair.start_send(rec):
            self._table.fail(rec, FailureReason.PEER_DEAD, f"not connected to {req.peer!r}")

    def send_layer(self, transfer_id: str, layer: int) -> None:
        rec = self._announce(transfer_id, layer)
        pair = self._pair(rec.req.peer)
        if rec.running and pair is not None:
            pair.send_layer(rec, layer)

    def start_recv(self, req: TransferRequest, cache: KVCache) -> None:
        self._check_device(cache)
        rec = self._table.add(req, Role.RECV, cache)
        pair = self._pair(req.peer)
        if pair is None or not pair.start_recv(rec):
            self._table.fail(rec, FailureReason.PEER_DEAD, f"not connected to {req.peer!r}")

    def _on_fail(self, rec: Transfer) -> None:
        pair = self._pair(rec.req.peer)
        if pair is not None:
            pair.transfer_failed(rec)

    def close(self) -> None:
        for rec in self._table.running():
            self._table.fail(rec, FailureReason.ABORTED, "connector closed")
        with self._lock:
            pairs = [pair for _, pair in self._pairs.values()]
            self._pairs.clear()
            self._listening.clear()
            self._stores.clear()
        for pair in pairs:
            pair.close(join_s=self._join_s)
        # Dropping the last references destroys the process groups now, while the interpreter
        # is whole; gloo groups still alive at interpreter teardown can abort the process.
        # A pair whose threads did not stop is freed by its last thread instead.
        pairs.clear()
        with self._lock:
            self._stores.clear()
