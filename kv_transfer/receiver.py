"""The receiving end of a pair's incoming lane: a thread that loops "recv a header, act", and a
copier thread that scatters landed data into the cache while the next message is on the wire.

After a LAYER header the next data message on the lane is that header's, so the receiver thread
posts that recv next; besides it, only the next header's recv is ever posted (and on NCCL, which
matches by order rather than tag, not even that until the data has landed). Data lands in one of
two staging slots and is handed to the copier; the receiver reuses a slot only after the copier
has given it back. Data for a transfer that has ended here (or was never registered) is still
received and dropped: skipping it would put the lane out of step.

A START waits up to `register_wait_s` for the matching `start_recv`; the lane's data is held
meanwhile, which is why the receiver should register first. Without one, the sender is told
(PEER_FAIL).

The copier scatters under the transfer's io_lock and only while it is running, so once a receive
has ended its destination blocks are never written again. It completes a receive (and queues the
ACK) when the last layer is in.

Direct receives: when the receive's destination ids are one ascending run `a..a+n-1`, the cache
can be a wire tensor (staging.py) and a message carries one layer (the sender decides that; a
grouped message still goes through staging), the receiver thread posts the data recv straight
into `layer[a:a+n]` and no copy follows. Invariant: that recv is posted and waited for entirely
under the transfer's io_lock, and only while the transfer is running. Every way a receive ends
(complete, abort, the deadline, a broken pair, a peer's ABORT) takes that lock, so none of them
can make the receive ended, and so hand its blocks back to their owner, while the wire may still
write them: a blocking end (abort, wait past the deadline, close) waits for the data, which the
peer posted together with its header (at most io_timeout_s, after which the pair breaks); a
non-blocking end (poll's deadline check, the lane threads) is applied by this thread as it lets
go of the lock (table.py).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kv_transfer.base import FailureReason
from kv_transfer.pair import Event, LaneError, Pair
from kv_transfer.staging import SLOTS
from kv_transfer.table import Transfer
from kv_transfer.wire import (
    HEADER_TAG,
    NO_CHECKSUM,
    Header,
    Kind,
    checksum,
    data_tag,
    tid_hash,
)

# Failures a receiver finds in the bytes it got: the sender's send failed for the same reason.
_DATA_FAULTS = (FailureReason.CORRUPT, FailureReason.MISMATCH)


@dataclass(slots=True)
class _Incoming:
    rec: Transfer
    layers: int = 0  # layers received for it, whether or not they were applied


class _Copy(NamedTuple):
    slot: int
    landed: torch.Tensor
    rec: Transfer
    first_layer: int
    num_layers: int
    nbytes: int


class LaneReceiver:
    def __init__(self, pair: Pair) -> None:
        self._pair = pair
        self._staging = pair.new_staging()
        self._incoming: dict[int, _Incoming] = {}  # seq -> receive matched to a START
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()  # slots the copier gave back
        for slot in range(SLOTS):
            self._free.put(slot)
        self._copies: queue.SimpleQueue[_Copy | None] = queue.SimpleQueue()

    def run(self) -> None:
        copier = threading.Thread(
            target=self._copier, name=f"kv-copy-{self._pair.peer_id}", daemon=True
        )
        copier.start()
        try:
            self._loop()
        except LaneError as e:
            self._pair.break_(f"receiving from {self._pair.peer_id!r} failed: {e}")
        except Exception as e:  # a bug here must still end the pair's transfers, not hang them
            self._pair.break_(f"receiver thread crashed: {type(e).__name__}: {e}")
            raise
        finally:
            self._copies.put(None)
            copier.join(self._pair.config.io_timeout_s)

    def _loop(self) -> None:
        pair, staging = self._pair, self._staging
        # gloo matches messages by tag, so the next header's recv can be posted before this
        # header is acted on (the peer's next header then never waits for a data landing or a
        # START's registration). NCCL matches by order only: there, strictly one at a time.
        early = pair.lanes.backend == "gloo"
        work = pair.post_recv(staging, staging.header, HEADER_TAG)
        while True:
            pair.finish([work], staging)
            h = Header.decode(staging.header)
            if h.kind is Kind.CLOSE:
                pair.break_(f"peer {pair.peer_id!r} closed the connection")
                return
            if early:
                work = pair.post_recv(staging, staging.header, HEADER_TAG)
            self._handle(h)
            if not early:
                work = pair.post_recv(staging, staging.header, HEADER_TAG)

    def _handle(self, h: Header) -> None:
        if h.kind is Kind.LAYER:
            self._on_layer(h)
        elif h.kind is Kind.START:
            self._on_start(h)
        elif h.kind is Kind.ABORT:
            self._on_abort(h)
        elif h.kind is Kind.PEER_FAIL:
            rec = self._pair.running_send(h.tid_hash)
            if rec is not None:
                why = h.reason.value if h.reason else "unknown"
                # What the receiver found wrong with the bytes is this send's failure too (the
                # senders' counters then say corrupt, not only that the peer ended it).
                reason = h.reason if h.reason in _DATA_FAULTS else FailureReason.PEER_ABORTED
                rec.peer_ended = True
                # Not waiting: the sender thread may hold the send's io_lock across a message.
                self._pair.table.fail(rec, reason, f"the receiver ended it ({why})", blocking=False)
        elif h.kind is Kind.ACK:
            rec = self._pair.running_send(h.tid_hash)
            self._pair.forget_send(h.tid_hash)
            if rec is not None:
                self._pair.table.complete_send(rec, acked=True)

    def _on_start(self, h: Header) -> None:
        pair = self._pair
        wait_s = min(h.deadline_ms / 1000, pair.config.register_wait_s)
        rec = pair.claim_recv(h.tid_hash, wait_s)
        if rec is None:
            pair.outbox.put(
                Event(Kind.PEER_FAIL, tid_hash=h.tid_hash, reason=FailureReason.TIMEOUT)
            )
            return
        self._incoming[h.seq] = _Incoming(rec)
        req = rec.req
        if (h.num_blocks, h.num_layers) != (req.num_blocks, req.num_layers):
            pair.table.fail(
                rec,
                FailureReason.MISMATCH,
                f"sender has {h.num_blocks} blocks x {h.num_layers} layers, "
                f"receiver expects {req.num_blocks} x {req.num_layers}",
            )

    def _on_layer(self, h: Header) -> None:
        pair = self._pair
        block_layers = h.num_blocks * h.num_layers
        if h.nbytes != block_layers * pair.layout.bytes_per_block_layer:
            raise LaneError(f"LAYER header: {h.nbytes} bytes for {block_layers} block-layers")
        rec = self._match(h)
        if (
            rec is not None
            and h.num_layers == 1
            and rec.run is not None
            and self._staging.direct
            and self._recv_direct(h, rec)
        ):
            return
        try:
            slot = self._free.get(timeout=pair.config.io_timeout_s)
        except queue.Empty:
            raise LaneError("the copier thread is stuck") from None
        landed = self._staging.landing(slot, block_layers)
        pair.recv(self._staging, landed, data_tag(h.seq))
        if rec is None:
            self._free.put(slot)  # dropped: see _match
            return
        if not self._intact(h, landed):
            self._free.put(slot)
            self._corrupt(rec, h)
            return
        self._copies.put(_Copy(slot, landed, rec, h.layer, h.num_layers, h.nbytes))

    def _intact(self, h: Header, data: torch.Tensor) -> bool:
        """Whether a message's bytes are what the sender checksummed (True when it did not)."""
        if h.checksum == NO_CHECKSUM:
            return True
        with self._staging.on_stream():
            return checksum(data) == h.checksum

    def _corrupt(self, rec: Transfer, h: Header) -> None:
        msg = f"layers {h.layer}..{h.layer + h.num_layers - 1} arrived corrupted (checksum)"
        # Not waiting: the copier may hold the receive's io_lock (it ends it as it lets go).
        self._pair.table.fail(rec, FailureReason.CORRUPT, msg, blocking=False)

    def _match(self, h: Header) -> Transfer | None:
        """The receive a LAYER header's data belongs to; None when it is to be dropped (never
        registered here, already settled, or a shape a MISMATCH has already failed)."""
        entry = self._incoming.get(h.seq)
        if entry is None:
            return None
        entry.layers += h.num_layers
        rec = entry.rec
        if entry.layers >= rec.req.num_layers:
            del self._incoming[h.seq]
        last = h.layer + h.num_layers - 1
        if h.num_blocks != rec.req.num_blocks or not 0 <= h.layer <= last < rec.req.num_layers:
            return None
        return rec

    def _recv_direct(self, h: Header, rec: Transfer) -> bool:
        """Receive one layer straight into its blocks. False, with nothing received, when the
        receive has ended: the data then goes through staging and is dropped."""
        assert rec.run is not None
        with self._pair.table.io(rec) as running:
            if not running:
                return False
            # Holding io_lock until the data is in, so the receive cannot end (abort, deadline,
            # a broken pair) while the wire may still write these blocks. The sender posted this
            # data with its header, so the wait is the data's wire time (at most io_timeout_s).
            blocks = rec.cache.layers[h.layer][rec.run]
            self._pair.recv(self._staging, blocks, data_tag(h.seq))
            self._staging.sync()
            intact = self._intact(h, blocks)
        if not intact:  # the blocks hold bad bytes: the receive ends, their owner recomputes
            self._corrupt(rec, h)
            return True
        self._landed(rec, h.nbytes, 1)
        return True

    def _on_abort(self, h: Header) -> None:
        entry = self._incoming.pop(h.seq, None)
        rec = entry.rec if entry is not None else self._pair.claim_recv(h.tid_hash, 0.0)
        if rec is not None:
            why = h.reason.value if h.reason else "unknown"
            msg = f"the sender ended it ({why})"
            self._pair.table.fail(rec, FailureReason.PEER_ABORTED, msg, blocking=False)

    def _copier(self) -> None:
        try:
            while (job := self._copies.get()) is not None:
                self._apply(job)
        except Exception as e:  # a bug here must still end the pair's transfers, not hang them
            self._pair.break_(f"copier thread crashed: {type(e).__name__}: {e}")
            raise

    def _apply(self, job: _Copy) -> None:
        rec = job.rec
        applied = False
        with self._pair.table.io(rec) as running:
            if running:
                layers = rec.cache.layers[job.first_layer : job.first_layer + job.num_layers]
                self._staging.scatter(job.slot, job.landed, layers, rec.block_index)
                applied = True
        self._free.put(job.slot)
        if applied:
            self._landed(rec, job.nbytes, job.num_layers)

    def _landed(self, rec: Transfer, nbytes: int, layers: int) -> None:
        """Count layers written into the cache; the last one completes the receive (either the
        receiver or the copier thread writes it) and queues the ACK."""
        self._pair.table.progress(rec, nbytes, layers)
        if rec.layers_done >= rec.req.num_layers and self._pair.table.complete(rec):
            self._pair.outbox.put(Event(Kind.ACK, tid_hash=tid_hash(rec.req.transfer_id)))
