"""One connected peer: its two lanes, the two threads that own them, and what they share.

    this process                                          peer process
    LaneSender thread   --- lane `out`: headers + data --->  LaneReceiver thread
    LaneReceiver thread <-- lane `inn`: headers + data ---   LaneSender thread

The sender thread is the only one that posts sends on `out`; the receiver thread is the only one
that posts recvs on `inn` (see sender.py and receiver.py). A lane error (peer death, a wait past
`io_timeout_s`, a garbled header) breaks the pair: every running transfer with this peer ends
FAILED (PEER_DEAD), both threads exit, and the pair is never used again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kv_transfer.base import FailureReason
from kv_transfer.faults import FaultInjector
from kv_transfer.layout import KVLayout
from kv_transfer.rendezvous import Lanes
from kv_transfer.staging import Staging
from kv_transfer.table import Role, Transfer, TransferTable
from kv_transfer.wire import Kind, tid_hash

_MAX_REFUSED = 4096


@dataclass(frozen=True, slots=True)
class PairConfig:
    io_timeout_s: float  # longest wait for any one message; past it the pair is broken
    heartbeat_s: float  # idle interval between heartbeats and deadline sweeps
    register_wait_s: float  # how long a START may wait for the matching start_recv
    max_message_bytes: int  # cap on one data message when queued layers are grouped
    checksum: bool = False  # the sender checksums each LAYER message (the receiver checks it)


@dataclass(frozen=True, slots=True)
class Event:
    """One item of the sender thread's outbox."""

    kind: Kind
    rec: Transfer | None = None
    layer: int = -1
    ready: torch.cuda.Event | None = None  # CUDA producers: the layer's write is done
    tid_hash: int = 0
    reason: FailureReason | None = None


class LaneError(Exception):
    """The lane is unusable; the pair must break."""


class Pair:
    def __init__(
        self,
        peer_id: str,
        rank: int,
        lanes: Lanes,
        table: TransferTable,
        layout: KVLayout,
        device: torch.device,
        config: PairConfig,
        faults: FaultInjector | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.faults = faults  # tests and benches only (faults.py)
        self.peer_rank = 1 - rank
        self.lanes = lanes
        self.table = table
        self.layout = layout
        self.device = device
        self.config = config
        self.outbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._cond = threading.Condition()  # guards the fields below
        self._alive = True
        self._next_seq = 0
        self._sends: dict[int, Transfer] = {}  # tid hash -> running send, for ACK and PEER_FAIL
        self._pending: dict[int, Transfer] = {}  # tid hash -> receive not yet matched to a START
        # Receives that ended before their START arrived: a late START is refused at once
        # instead of holding the lane for register_wait_s. Bounded; oldest forgotten first.
        self._refused: dict[int, None] = {}
        self._threads: list[threading.Thread] = []

    def start(self, loops: dict[str, Callable[[], None]]) -> None:
        """Run the lane loops (a LaneSender's and a LaneReceiver's `run`), one thread each."""
        for name, loop in loops.items():
            t = threading.Thread(target=loop, name=f"kv-{name}-{self.peer_id}", daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def alive(self) -> bool:
        with self._cond:
            return self._alive

    def new_staging(self) -> Staging:
        return Staging(self.layout, self.device, self.lanes.backend)

    # ---- calls from the connector (any thread) ----

    def start_send(self, rec: Transfer) -> bool:
        with self._cond:
            if not self._alive:
                return False
            rec.seq = self._next_seq
            self._next_seq += 1
            self._sends[tid_hash(rec.req.transfer_id)] = rec
        self.outbox.put(Event(Kind.START, rec))
        return True

    def send_layer(self, rec: Transfer, layer: int) -> None:
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # on the producer's current stream
        self.outbox.put(Event(Kind.LAYER, rec, layer, ready))

    def start_recv(self, rec: Transfer) -> bool:
        with self._cond:
            if not self._alive:
                return False
            h = tid_hash(rec.req.transfer_id)
            self._refused.pop(h, None)
            self._pending[h] = rec
            self._cond.notify_all()
        return True

    def transfer_failed(self, rec: Transfer) -> None:
        """Tell the peer about a local failure, unless the peer caused it or is gone."""
        h = tid_hash(rec.req.transfer_id)
        with self._cond:
            self._sends.pop(h, None)
            if self._pending.pop(h, None) is not None:
                self._refused[h] = None
                if len(self._refused) > _MAX_REFUSED:
                    del self._refused[next(iter(self._refused))]
            if not self._alive:
                return
        if rec.peer_ended or rec.reason in (FailureReason.PEER_ABORTED, FailureReason.PEER_DEAD):
            return
        kind = Kind.ABORT if rec.role is Role.SEND else Kind.PEER_FAIL
        self.outbox.put(Event(kind, rec, tid_hash=h, reason=rec.reason))

    def close(self, join_s: float) -> bool:
        """Say goodbye to the peer and stop the lane threads, waiting at most `join_s` (the
        receiver stops when the peer's CLOSE arrives). True when all of them stopped: only then
        may the lanes be destroyed from this thread."""
        self.outbox.put(Event(Kind.CLOSE))
        end = time.monotonic() + join_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        self.break_("connection closed")
        return not any(t.is_alive() for t in self._threads)

    # ---- calls from the lane threads ----

    def break_(self, why: str) -> None:
        with self._cond:
            if not self._alive:
                return
            self._alive = False
            self._cond.notify_all()
        self.outbox.put(Event(Kind.CLOSE))
        # Not waiting: a lane thread may hold a transfer's io_lock across a message (it ends
        # that transfer as it lets go).
        self.table.fail_peer(self.peer_id, FailureReason.PEER_DEAD, why, blocking=False)

    def claim_recv(self, h: int, timeout_s: float) -> Transfer | None:
        """The receive registered for tid hash `h`, waiting up to `timeout_s` for start_recv."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while h not in self._pending and h not in self._refused and self._alive:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._pending.pop(h, None)

    def running_send(self, h: int) -> Transfer | None:
        with self._cond:
            return self._sends.get(h)

    def forget_send(self, h: int) -> None:
        with self._cond:
            self._sends.pop(h, None)

    def sweep_deadlines(self) -> None:
        for rec in self.table.running(self.peer_id):
            self.table.expire(rec)

    def post(self, staging: Staging, messages: list[tuple[torch.Tensor, int]]) -> list[dist.Work]:
        """Post a send of each (tensor, tag) on `out`, in order; `finish` waits for them."""
        try:
            with staging.on_stream():
                return [self.lanes.out.send([t], self.peer_rank, tag) for t, tag in messages]
        except Exception as e:  # the lane is gone
            raise LaneError(f"{type(e).__name__}: {e}") from e

    def finish(self, works: list[dist.Work], staging: Staging) -> None:
        try:
            for work in works:
                self._wait(work, staging)
        except Exception as e:  # a failed or timed-out wait leaves the lane out of step
            raise LaneError(f"{type(e).__name__}: {e}") from e

    def send(self, staging: Staging, messages: list[tuple[torch.Tensor, int]]) -> None:
        self.finish(self.post(staging, messages), staging)

    def post_recv(self, staging: Staging, buf: torch.Tensor, tag: int) -> dist.Work:
        """Post a recv of the message with `tag` on `inn` into `buf`; `finish` waits for it."""
        try:
            with staging.on_stream():
                return self.lanes.inn.recv([buf], self.peer_rank, tag)
        except Exception as e:  # the lane is gone
            raise LaneError(f"{type(e).__name__}: {e}") from e

    def recv(self, staging: Staging, buf: torch.Tensor, tag: int) -> None:
        self.finish([self.post_recv(staging, buf, tag)], staging)

    def _wait(self, work: dist.Work, staging: Staging) -> None:
        """At most `io_timeout_s`. A gloo wait that times out also closes the connection, so
        any failure here ends the pair."""
        timeout_s = self.config.io_timeout_s
        if self.lanes.backend == "gloo":
            work.wait(timedelta(seconds=timeout_s))
            return
        # NCCL's wait() only orders streams; completion is observed by polling.
        end = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > end:
                raise TimeoutError(f"no progress in {timeout_s}s")
            time.sleep(50e-6)
        with staging.on_stream():
            work.wait()
