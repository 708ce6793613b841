"""The sending end of a pair's outgoing lane: one thread, draining the pair's outbox in order.

Outbox items become wire messages in the order they were queued (wire.py): START when a send is
registered, LAYER when the producer announces a layer, ABORT / PEER_FAIL when a local failure must
reach the peer, ACK when a receive completes, HEARTBEAT when idle for `heartbeat_s`, CLOSE on the
way out. Layers of concurrent transfers interleave in the order prefill finishes them; LAYER items
of one transfer for consecutive layers that are already queued go out as one message.

Pipelining: the next message's gather runs while the previous message is on the wire (two staging
slots), but a message is posted only after the previous one completed, so the lane's order is
exactly the outbox order. A layer is gathered under the transfer's io_lock and only while it is
running, so once a send has ended its source blocks are never read again.

Direct sends: a message of one layer whose source ids are one ascending run `a..a+n-1` needs no
gather where the cache itself can be a wire tensor (staging.py): it goes out straight from
`layer[a:a+n]`, the same bytes a gather would produce. The transfer's io_lock is then held from
posting the message until it has completed, so the send cannot end (DONE, FAILED, abort
returning) while the wire may still read the cache. Layers already queued together still travel
as one gathered message when several fit in `max_message_bytes`: for small layers one message
costs less than a copy (each message is a round trip between the lane threads).
"""

from __future__ import annotations

import queue
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from kv_transfer.pair import Event, LaneError, Pair
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


class _InFlight(NamedTuple):
    works: list[dist.Work]
    rec: Transfer
    nbytes: int
    layers: int


class LaneSender:
    def __init__(self, pair: Pair) -> None:
        self._pair = pair
        self._staging = pair.new_staging()
        self._last_sweep = time.monotonic()
        self._held: Event | None = None  # taken from the outbox while grouping; goes next
        self._in_flight: _InFlight | None = None  # the posted, unfinished LAYER message
        self._slot = 0

    def run(self) -> None:
        try:
            self._loop()
        except LaneError as e:
            self._pair.break_(f"sending to {self._pair.peer_id!r} failed: {e}")
        except Exception as e:  # a bug here must still end the pair's transfers, not hang them
            self._pair.break_(f"sender thread crashed: {type(e).__name__}: {e}")
            raise

    def _next(self) -> Event:
        if self._held is not None:
            ev, self._held = self._held, None
            return ev
        try:
            return self._pair.outbox.get_nowait()
        except queue.Empty:
            pass
        self._flush()  # nothing to overlap with: finish the message on the wire first
        try:
            return self._pair.outbox.get(timeout=self._pair.config.heartbeat_s)
        except queue.Empty:
            return Event(Kind.HEARTBEAT)

    def _loop(self) -> None:
        pair = self._pair
        while True:
            ev = self._next()
            now = time.monotonic()
            if now - self._last_sweep >= pair.config.heartbeat_s:
                self._last_sweep = now
                pair.sweep_deadlines()
            if ev.kind is Kind.CLOSE:
                self._goodbye()
                return
            if ev.kind is Kind.LAYER:
                self._send_layers(ev)
            elif ev.kind is Kind.START:
                self._send_start(ev)
            elif ev.kind is Kind.ABORT:
                assert ev.rec is not None
                self._send(Header(Kind.ABORT, ev.rec.seq, ev.tid_hash, reason=ev.reason))
            else:  # PEER_FAIL, ACK, HEARTBEAT
                self._send(Header(ev.kind, tid_hash=ev.tid_hash, reason=ev.reason))

    def _flush(self) -> None:
        """Wait for the LAYER message on the wire, then count it."""
        if self._in_flight is None:
            return
        works, rec, nbytes, layers = self._in_flight
        self._in_flight = None
        self._pair.finish(works, self._staging)
        self._counted(rec, nbytes, layers)

    def _send(self, header: Header) -> None:
        self._flush()
        with self._staging.on_stream():
            buf = header.encode(self._staging.header)
        self._pair.send(self._staging, [(buf, HEADER_TAG)])

    def _send_start(self, ev: Event) -> None:
        rec = ev.rec
        assert rec is not None
        if not rec.running:
            return  # its ABORT is queued behind; that tells a registered receiver
        left_ms = max(1, int((rec.deadline - time.monotonic()) * 1000))
        req = rec.req
        h = tid_hash(req.transfer_id)
        self._send(
            Header(Kind.START, rec.seq, h, req.num_blocks, req.num_layers, deadline_ms=left_ms)
        )

    def _layer_group(self, first: Event) -> list[Event]:
        """`first` and the LAYER events for the next layers of the same transfer that are
        already queued, up to `max_message_bytes`: one message instead of several when the
        producer is ahead of the wire (always, for send_all_layers)."""
        rec = first.rec
        assert rec is not None
        per_layer = rec.req.num_blocks * self._pair.layout.bytes_per_block_layer
        group = [first]
        faults = self._pair.faults
        if faults is not None and faults.one_layer_per_message(rec):
            return group
        while (len(group) + 1) * per_layer <= self._pair.config.max_message_bytes:
            try:
                ev = self._pair.outbox.get_nowait()
            except queue.Empty:
                break
            if ev.kind is Kind.LAYER and ev.rec is rec and ev.layer == group[-1].layer + 1:
                group.append(ev)
            else:
                self._held = ev
                break
        return group

    def _send_layers(self, first: Event) -> None:
        group = self._layer_group(first)
        rec = first.rec
        assert rec is not None
        faults = self._pair.faults
        if faults is not None and not faults.before_layers(rec):
            return  # dropped by fault injection: the send ends at its deadline
        direct = faults is None or not faults.needs_copy(rec)
        if len(group) == 1 and rec.run is not None and self._staging.direct and direct:
            self._send_direct(first, rec)
            return
        with self._pair.table.io(rec) as running:
            if not running:
                return
            data = self._staging.gather(
                self._slot,
                [rec.cache.layers[ev.layer] for ev in group],
                rec.block_index,
                [ev.ready for ev in group if ev.ready is not None],
            )
        self._slot ^= 1
        nbytes = data.numel() * data.element_size()
        csum = self._checksum(data)
        if faults is not None:
            faults.corrupt(rec, data)
        header = Header(
            Kind.LAYER,
            rec.seq,
            num_blocks=rec.req.num_blocks,
            num_layers=len(group),
            layer=first.layer,
            nbytes=nbytes,
            checksum=csum,
        )
        self._flush()  # the previous message completes before this one is posted
        with self._staging.on_stream():
            buf = header.encode(self._staging.header)
        works = self._pair.post(self._staging, [(buf, HEADER_TAG), (data, data_tag(rec.seq))])
        self._in_flight = _InFlight(works, rec, nbytes, len(group))

    def _send_direct(self, ev: Event, rec: Transfer) -> None:
        """One layer straight from the cache; returns once the message has left it."""
        assert rec.run is not None
        data = rec.cache.layers[ev.layer][rec.run]
        nbytes = data.numel() * data.element_size()
        self._flush()
        with self._pair.table.io(rec) as running:
            if not running:
                return
            with self._staging.on_stream():
                self._staging.wait_ready([ev.ready] if ev.ready is not None else [])
            header = Header(
                Kind.LAYER,
                rec.seq,
                num_blocks=rec.req.num_blocks,
                num_layers=1,
                layer=ev.layer,
                nbytes=nbytes,
                checksum=self._checksum(data),
            )
            with self._staging.on_stream():
                buf = header.encode(self._staging.header)
            # io_lock is held until the wire is done with the cache (at most io_timeout_s).
            # Posting the next layer before this one completes measured slower on gloo.
            self._pair.send(self._staging, [(buf, HEADER_TAG), (data, data_tag(rec.seq))])
        self._counted(rec, nbytes, 1)

    def _checksum(self, data: torch.Tensor) -> int:
        """The message's checksum, taken on the staging stream (after its gather or its
        producer's write), or NO_CHECKSUM when this side does not checksum."""
        if not self._pair.config.checksum:
            return NO_CHECKSUM
        with self._staging.on_stream():
            return checksum(data)

    def _counted(self, rec: Transfer, nbytes: int, layers: int) -> None:
        """A message has left: count it; it may be the last the receiver's ACK waited for."""
        self._pair.table.progress(rec, nbytes, layers)
        self._pair.table.complete_send(rec)
        if self._pair.faults is not None:
            self._pair.faults.sent(rec, layers, self._pair.break_)

    def _goodbye(self) -> None:
        """Tell the peer this lane is closing, so its receiver stops at once. Best effort."""
        try:
            self._send(Header(Kind.CLOSE))
        except LaneError:
            pass
