"""An in-process connector for unit tests: endpoints on a `FakeHub` copy blocks straight between
two `KVCache` objects, in the caller's thread, with the statuses, deadlines, block ownership and
failure propagation of the real connector (see base.py).

Test knobs on an endpoint:
  - `stall()`: layers announced from now on vanish, as on a dead link, so transfers end FAILED
    (TIMEOUT) at their deadline; `stall(False)` restores delivery for later layers;
  - `fail_next_send(after_layers)`: the next send started fails (ERROR) once that many layers
    have moved;
  - `FakeHub.kill(name)`: the endpoint disappears; its peers' transfers end FAILED (PEER_DEAD).
Layers that arrive before the receiver's `start_recv` wait in an inbox, as on a real wire.
"""

from __future__ import annotations

import threading

import torch

from engine.kv_cache import KVCache
from kv_transfer.base import FailureReason, TransferRequest
from kv_transfer.layout import KVLayout, check_compatible
from kv_transfer.table import Role, TrackedConnector, Transfer


class FakeHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, FakeConnector] = {}

    def connector(self, name: str, layout: KVLayout) -> FakeConnector:
        conn = FakeConnector(self, name, layout)
        with self._lock:
            if name in self._endpoints:
                raise ValueError(f"endpoint {name!r} already exists")
            self._endpoints[name] = conn
        return conn

    def lookup(self, name: str) -> FakeConnector | None:
        with self._lock:
            return self._endpoints.get(name)

    def kill(self, name: str) -> None:
        """Remove an endpoint as if its process died."""
        with self._lock:
            self._endpoints.pop(name, None)
            others = list(self._endpoints.values())
        for conn in others:
            conn._table.fail_peer(name, FailureReason.PEER_DEAD, f"peer {name!r} died")


class FakeConnector(TrackedConnector):
    def __init__(self, hub: FakeHub, name: str, layout: KVLayout) -> None:
        super().__init__(layout)
        self.hub = hub
        self.name = name
        self._lock = threading.Lock()  # guards the fields below
        self._stalled = False
        self._fail_after: int | None = None
        self._fail_at: dict[str, int] = {}  # transfer id -> layers moved before the injected fail
        self._inbox: dict[str, list[tuple[int, torch.Tensor]]] = {}  # layers before start_recv

    def stall(self, on: bool = True) -> None:
        with self._lock:
            self._stalled = on

    def fail_next_send(self, after_layers: int = 0) -> None:
        with self._lock:
            self._fail_after = after_layers

    def _peer(self, name: str) -> FakeConnector | None:
        peer = self.hub.lookup(name)
        if peer is not None:
            check_compatible(self.layout, peer.layout)
        return peer

    def start_send(self, req: TransferRequest, cache: KVCache) -> None:
        peer = self._peer(req.peer)
        rec = self._table.add(req, Role.SEND, cache)
        with self._lock:
            if self._fail_after is not None:
                self._fail_at[req.transfer_id] = self._fail_after
                self._fail_after = None
        if peer is None:
            self._table.fail(rec, FailureReason.PEER_DEAD, f"no endpoint {req.peer!r}")

    def send_layer(self, transfer_id: str, layer: int) -> None:
        rec = self._announce(transfer_id, layer)
        with self._lock:
            stalled = self._stalled
            fail_at = self._fail_at.get(transfer_id)
        self._table.expire(rec)
        if stalled:
            return
        if fail_at is not None and rec.layers_done >= fail_at:
            self._table.fail(rec, FailureReason.ERROR, "injected failure")
            return
        with self._table.io(rec) as running:
            if not running:
                return
            data = rec.cache.layers[layer].index_select(0, rec.block_index)
        peer = self.hub.lookup(rec.req.peer)
        if peer is None:
            self._table.fail(rec, FailureReason.PEER_DEAD, f"peer {rec.req.peer!r} died")
            return
        self._table.progress(rec, data.numel() * data.element_size())
        peer._deliver(transfer_id, layer, data)

    def start_recv(self, req: TransferRequest, cache: KVCache) -> None:
        peer = self._peer(req.peer)
        rec = self._table.add(req, Role.RECV, cache)
        if peer is None:
            self._table.fail(rec, FailureReason.PEER_DEAD, f"no endpoint {req.peer!r}")
            return
        with self._lock:
            early = self._inbox.pop(req.transfer_id, [])
        for layer, data in early:
            self._apply(rec, layer, data)

    def _deliver(self, transfer_id: str, layer: int, data: torch.Tensor) -> None:
        rec = self._table.find(transfer_id)
        if rec is None or rec.role is not Role.RECV:
            with self._lock:
                self._inbox.setdefault(transfer_id, []).append((layer, data))
            return
        self._apply(rec, layer, data)

    def _apply(self, rec: Transfer, layer: int, data: torch.Tensor) -> None:
        self._table.expire(rec)
        if data.shape[0] != rec.req.num_blocks:
            self._table.fail(
                rec,
                FailureReason.MISMATCH,
                f"sender has {data.shape[0]} blocks, receiver expects {rec.req.num_blocks}",
            )
            return
        with self._table.io(rec) as running:
            if not running:
                return
            rec.cache.layers[layer].index_copy_(0, rec.block_index, data)
        self._table.progress(rec, data.numel() * data.element_size())
        if rec.layers_done == rec.req.num_layers and self._table.complete(rec):
            sender = self.hub.lookup(rec.req.peer)
            if sender is not None:
                sender._peer_done(rec.req.transfer_id)

    def _peer_done(self, transfer_id: str) -> None:
        rec = self._table.find(transfer_id)
        if rec is not None and rec.role is Role.SEND:
            self._table.complete(rec)

    def _peer_failed(
        self, transfer_id: str, peer_role: Role, why: str, reason: FailureReason | None = None
    ) -> None:
        with self._lock:
            self._inbox.pop(transfer_id, None)
        rec = self._table.find(transfer_id)
        if rec is not None and rec.role is not peer_role:
            # As the real connector: what the receiver found wrong in the bytes is the sender's
            # failure too.
            data = reason in (FailureReason.CORRUPT, FailureReason.MISMATCH)
            rec.peer_ended = True
            self._table.fail(
                rec, reason if data and reason else FailureReason.PEER_ABORTED,
                f"peer ended it: {why}",
            )  # fmt: skip

    def _on_fail(self, rec: Transfer) -> None:
        if rec.peer_ended or rec.reason in (FailureReason.PEER_ABORTED, FailureReason.PEER_DEAD):
            return  # the peer already knows: it told us, or it is gone
        peer = self.hub.lookup(rec.req.peer)
        if peer is not None:
            reason = rec.reason.value if rec.reason else "failed"
            peer._peer_failed(rec.req.transfer_id, rec.role, f"{reason}: {rec.error}", rec.reason)

    def close(self) -> None:
        for rec in self._table.running():
            self._table.fail(rec, FailureReason.ABORTED, "connector closed")
        self.hub.kill(self.name)
