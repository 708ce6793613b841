"""Bookkeeping shared by connectors: the transfer records, their statuses, deadlines and stats.

Locking (this is what makes "after FAILED nobody touches the blocks" hold):
  - `Transfer.io_lock` is held by whoever reads source blocks or writes destination blocks
    (`TransferTable.io`), for a copy or for as long as a message sent from or received into the
    cache itself is posted (torch_dist's direct messages, sender.py and receiver.py).
  - A transfer becomes DONE or FAILED only while both its `io_lock` and the table lock are held.
    So under `io_lock`, a transfer seen running stays running until the lock is released.
  - A non-blocking `fail` that finds `io_lock` held leaves the failure with the record; the
    holder applies it when it lets go (`io`). Threads that must not wait on a wire (the lane
    threads) fail transfers this way; callers that must know the blocks are free (abort, close,
    wait past the deadline) block instead.
  - A send's ACK ends it DONE only once the sender thread has counted every layer
    (`complete_send`): DONE reports every byte, and the thread that reads the ACK does not wait
    for a send the sender thread is still busy with.
  - No cycle of waits forms through these locks: a lane thread holding one across a message
    waits only for the other end of that message (a data send the peer posted with its header,
    or the peer's receiver thread, which never waits for a lock held across a message).
  - Order: `io_lock` before the table lock, never the reverse. `on_fail` hooks run with no lock
    held, so a hook may enqueue messages or fail other transfers.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.kv_cache import KVCache
from kv_transfer.base import (
    FailureReason,
    KVConnector,
    TransferRequest,
    TransferResult,
    TransferStats,
    TransferStatus,
)
from kv_transfer.layout import KVLayout


class Role(enum.Enum):
    SEND = "send"
    RECV = "recv"


@dataclass(slots=True, eq=False)
class Transfer:
    req: TransferRequest
    role: Role
    cache: KVCache
    block_index: torch.Tensor  # this side's block ids (src for SEND, dst for RECV), on the device
    run: slice | None  # the same ids as `slice(a, a + n)` when they are a..a+n-1 in order
    started: float  # time.monotonic() at the start call
    deadline: float  # monotonic
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    status: TransferStatus = TransferStatus.PENDING
    bytes: int = 0
    layers_done: int = 0
    ended: float = 0.0
    reason: FailureReason | None = None
    error: str | None = None
    seq: int = -1  # the wire sequence number, where a connector uses one
    deferred: tuple[FailureReason, str] | None = None  # a failure left for the io_lock holder
    acked: bool = False  # SEND: the receiver has acknowledged every layer
    peer_ended: bool = False  # the peer ended it (nothing to tell the peer back)
    # SEND, under fault injection (faults.py) only: struck, and its layers sent since.
    fault: bool = False
    fault_layers: int = 0

    @property
    def running(self) -> bool:
        return not self.status.finished


FailHook = Callable[[Transfer], None]


class TransferTable:
    def __init__(self, layout: KVLayout, on_fail: FailHook) -> None:
        self.layout = layout
        self._on_fail = on_fail
        self._cond = threading.Condition()  # guards everything below; notified on every end
        self._records: dict[str, Transfer] = {}
        self._stats = TransferStats()

    def add(self, req: TransferRequest, role: Role, cache: KVCache) -> Transfer:
        if not self.layout.matches_spec(cache.spec):
            raise ValueError(f"cache spec {cache.spec} does not match layout {self.layout}")
        if req.num_layers > self.layout.num_layers:
            raise ValueError(f"num_layers {req.num_layers} > layout's {self.layout.num_layers}")
        ids = req.src_block_ids if role is Role.SEND else req.dst_block_ids
        bad = [b for b in ids if not 0 <= b < cache.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} outside the cache's {cache.num_blocks} blocks")
        index = torch.tensor(ids, dtype=torch.long, device=cache.layers[0].device)
        run = slice(ids[0], ids[0] + len(ids)) if _one_run(ids) else None
        now = time.monotonic()
        rec = Transfer(req, role, cache, index, run, now, now + req.deadline_s)
        with self._cond:
            if req.transfer_id in self._records:
                raise ValueError(f"transfer {req.transfer_id!r} is already registered")
            self._records[req.transfer_id] = rec
        return rec

    def get(self, transfer_id: str) -> Transfer:
        with self._cond:
            return self._records[transfer_id]

    def find(self, transfer_id: str) -> Transfer | None:
        with self._cond:
            return self._records.get(transfer_id)

    def __len__(self) -> int:
        """Records not yet released, running or ended."""
        with self._cond:
            return len(self._records)

    def running(self, peer: str | None = None) -> list[Transfer]:
        with self._cond:
            return [
                r
                for r in self._records.values()
                if r.running and (peer is None or r.req.peer == peer)
            ]

    @contextmanager
    def io(self, rec: Transfer) -> Iterator[bool]:
        """Hold `rec.io_lock` to touch its blocks; yields whether it is running (if so, it stays
        running until the block exits). A failure left meanwhile is applied on the way out."""
        try:
            with rec.io_lock:
                yield rec.running
        finally:
            deferred = rec.deferred
            if deferred is not None:
                self.fail(rec, *deferred, blocking=False)

    def progress(self, rec: Transfer, nbytes: int, layers: int = 1) -> None:
        """Layers moved. Counted even if the transfer has just ended: the bytes did move."""
        with self._cond:
            rec.bytes += nbytes
            rec.layers_done += layers
            if rec.role is Role.SEND:
                self._stats.bytes_sent += nbytes
            else:
                self._stats.bytes_received += nbytes
            if rec.status is TransferStatus.PENDING:
                rec.status = TransferStatus.TRANSFERRING

    def complete(self, rec: Transfer) -> bool:
        """End DONE unless already ended. Must not be called with `rec.io_lock` held."""
        with rec.io_lock, self._cond:
            if not rec.running:
                return False
            rec.status = TransferStatus.DONE
            rec.ended = time.monotonic()
            secs = max(rec.ended - rec.started, 1e-9)
            self._stats.ok += 1
            self._stats.seconds += secs
            self._stats.last_gb_s = rec.bytes / secs / 1e9
            self._cond.notify_all()
        return True

    def complete_send(self, rec: Transfer, *, acked: bool = False) -> bool:
        """End a send DONE once the receiver has acknowledged every layer (`acked`: the ACK is
        here) and this side has counted them all: the ACK can overtake the sender thread's count
        of its last message, and DONE reports every byte. Must not be called with `rec.io_lock`
        held."""
        with self._cond:
            rec.acked = rec.acked or acked
            ready = rec.acked and rec.layers_done >= rec.req.num_layers
        return ready and self.complete(rec)

    def fail(
        self, rec: Transfer, reason: FailureReason, error: str, *, blocking: bool = True
    ) -> bool:
        """End FAILED unless already ended; then run the hook. Must not be called with
        `rec.io_lock` held. While another thread holds it, a blocking call waits; a non-blocking
        one leaves the failure for the holder to apply on release and returns False."""
        if not rec.io_lock.acquire(blocking=blocking):
            with self._cond:
                if rec.running and rec.deferred is None:
                    rec.deferred = (reason, error)
            # The holder may have let go before the failure was left: then apply it here.
            if not rec.io_lock.acquire(blocking=False):
                return False  # the holder (or the next one) sees `deferred` on release
            reason, error = rec.deferred or (reason, error)
        try:
            with self._cond:
                if not rec.running:
                    return False
                rec.status = TransferStatus.FAILED
                rec.ended = time.monotonic()
                rec.reason, rec.error = reason, error
                self._stats.failed += 1
                self._stats.failures[reason] = self._stats.failures.get(reason, 0) + 1
                self._cond.notify_all()
        finally:
            rec.io_lock.release()
        self._on_fail(rec)
        return True

    def fail_peer(
        self, peer: str, reason: FailureReason, error: str, *, blocking: bool = True
    ) -> None:
        for rec in self.running(peer):
            self.fail(rec, reason, error, blocking=blocking)

    def expire(self, rec: Transfer, *, blocking: bool = False) -> None:
        if rec.running and time.monotonic() > rec.deadline:
            self.fail(
                rec,
                FailureReason.TIMEOUT,
                f"deadline of {rec.req.deadline_s:.3g}s passed after "
                f"{rec.layers_done}/{rec.req.num_layers} layers",
                blocking=blocking,
            )

    def poll(self, transfer_id: str) -> TransferStatus:
        rec = self.get(transfer_id)
        self.expire(rec)
        return rec.status

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        rec = self.get(transfer_id)
        end = time.monotonic() + timeout_s
        while True:
            with self._cond:
                now = time.monotonic()
                if not rec.running or now >= end:
                    return rec.status
                if now <= rec.deadline:
                    self._cond.wait(min(end, rec.deadline) - now + 1e-3)
                    continue
            self.expire(rec, blocking=True)

    def result(self, transfer_id: str) -> TransferResult | None:
        rec = self.get(transfer_id)
        self.expire(rec)
        with self._cond:
            if rec.running:
                return None
            secs = rec.ended - rec.started
            return TransferResult(
                rec.req.transfer_id, rec.status, rec.bytes, secs, rec.reason, rec.error
            )

    def release(self, transfer_id: str) -> None:
        with self._cond:
            rec = self._records.get(transfer_id)
            if rec is None:
                return
            if rec.running:
                raise RuntimeError(f"transfer {transfer_id!r} is still running; abort it first")
            del self._records[transfer_id]

    def stats(self) -> TransferStats:
        with self._cond:
            return self._stats.copy()


def _one_run(ids: tuple[int, ...]) -> bool:
    return all(b == ids[0] + i for i, b in enumerate(ids))


class TrackedConnector(KVConnector):
    """The status side of `KVConnector`, kept in a `TransferTable`. Subclasses move the bytes and
    react to failures in `_on_fail` (e.g. tell the peer)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._table = TransferTable(layout, self._on_fail)
        self._announce_lock = threading.Lock()
        self._announced: dict[str, set[int]] = {}  # send transfer id -> layers handed over

    def _announce(self, transfer_id: str, layer: int) -> Transfer:
        """Check a `send_layer` call (a send, a layer in range, each layer once) and record it."""
        rec = self._table.get(transfer_id)
        if rec.role is not Role.SEND:
            raise ValueError(f"{transfer_id!r} is a receive")
        if not 0 <= layer < rec.req.num_layers:
            raise ValueError(f"layer {layer} outside 0..{rec.req.num_layers - 1}")
        with self._announce_lock:
            announced = self._announced.setdefault(transfer_id, set())
            if layer in announced:
                raise ValueError(f"layer {layer} of {transfer_id!r} announced twice")
            announced.add(layer)
        return rec

    def _on_fail(self, rec: Transfer) -> None:
        """A transfer has just ended FAILED. Runs with no lock held."""

    def poll(self, transfer_id: str) -> TransferStatus:
        return self._table.poll(transfer_id)

    def num_records(self) -> int:
        """Transfers this connector still tracks (not yet released): 0 when idle."""
        return len(self._table)

    def result(self, transfer_id: str) -> TransferResult | None:
        return self._table.result(transfer_id)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        return self._table.wait(transfer_id, timeout_s)

    def abort(self, transfer_id: str) -> None:
        rec = self._table.find(transfer_id)
        if rec is not None:
            self._table.fail(rec, FailureReason.ABORTED, "aborted by this side")

    def release(self, transfer_id: str) -> None:
        self._table.release(transfer_id)
        with self._announce_lock:
            self._announced.pop(transfer_id, None)

    def stats(self) -> TransferStats:
        return self._table.stats()
