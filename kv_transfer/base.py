"""The KV connector interface: move a request's paged KV blocks from a prefill worker's cache into
blocks a decode worker reserved for it, layer by layer, without blocking either caller.

Lifecycle of one transfer (same `transfer_id` on both sides; each side names the other as `peer`):

    receiver (decode)                          sender (prefill)
    reserve dst blocks
    start_recv(req, cache)      -- control -->  start_send(req, cache)
                                                 compute layer 0; send_layer(tid, 0)
                                                 compute layer 1; send_layer(tid, 1) ...
    poll(tid): PENDING -> TRANSFERRING -> DONE | FAILED   (both sides, never blocks)
    result(tid) -> TransferResult                          (once DONE or FAILED)
    release(tid)                                           (forget it; stats keep the totals)

`start_recv` should come before `start_send` (the decode side reserves first; see DESIGN.md). A
connector may hold the pair's wire until the receiver has registered the transfer.

Block ownership: the connector borrows blocks, it never frees them.
  - The sender reads its source blocks until the transfer is DONE or FAILED; its owner frees them
    only then.
  - The receiver's reserved destination blocks are written until the transfer is DONE or FAILED.
    On DONE they hold the KV; on FAILED their owner frees them (and typically recomputes).
  - Once `poll` has returned DONE or FAILED, or `abort` has returned, the connector touches
    neither side's blocks for that transfer again.

Every transfer has a deadline (`deadline_s` seconds after its start call on each side). Deadline,
abort, or peer death end it FAILED with a `FailureReason` and a message; nothing waits forever.
A sender reports DONE only once the receiver has every layer, so DONE means the same on both sides.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engine.kv_cache import KVCache
from kv_transfer.layout import KVLayout


class TransferStatus(enum.Enum):
    PENDING = "pending"  # registered, no layer moved yet
    TRANSFERRING = "transferring"  # at least one layer moved
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TransferStatus.DONE, TransferStatus.FAILED)


class FailureReason(enum.Enum):
    TIMEOUT = "timeout"  # the transfer's deadline passed
    ABORTED = "aborted"  # this side called abort (or closed the connector)
    PEER_ABORTED = "peer_aborted"  # the other side aborted, timed out, or refused the transfer
    PEER_DEAD = "peer_dead"  # the pair's connection broke or was never made
    MISMATCH = "mismatch"  # the two sides disagree on the transfer's shape
    CORRUPT = "corrupt"  # a layer's bytes arrived other than sent (its checksum differs)
    ERROR = "error"  # anything else (message says what)


@dataclass(frozen=True, slots=True)
class TransferRequest:
    transfer_id: str
    peer: str  # the other side's peer id, as passed to connect
    src_block_ids: tuple[int, ...]  # in the sender's cache
    dst_block_ids: tuple[int, ...]  # in the receiver's cache; src_block_ids[i] -> dst_block_ids[i]
    num_layers: int  # layers 0 .. num_layers-1 travel
    deadline_s: float  # seconds from this side's start call

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(
                f"src_block_ids has {len(self.src_block_ids)} blocks, "
                f"dst_block_ids has {len(self.dst_block_ids)}"
            )
        if not self.src_block_ids:
            raise ValueError("a transfer needs at least one block")
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids):
            raise ValueError("dst_block_ids repeats a block")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


@dataclass(frozen=True, slots=True)
class TransferResult:
    transfer_id: str
    status: TransferStatus  # DONE or FAILED
    bytes: int  # bytes this side moved (all of them when DONE)
    seconds: float  # from the start call to the end
    reason: FailureReason | None = None
    error: str | None = None  # human-readable cause when FAILED


@dataclass(slots=True)
class TransferStats:
    """Totals since the connector was made; `stats()` hands out copies."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # summed over DONE transfers
    ok: int = 0
    failed: int = 0
    failures: dict[FailureReason, int] = field(default_factory=dict)
    last_gb_s: float = 0.0  # bandwidth of the latest DONE transfer (1e9 bytes per second)

    def copy(self) -> TransferStats:
        return TransferStats(
            self.bytes_sent,
            self.bytes_received,
            self.seconds,
            self.ok,
            self.failed,
            dict(self.failures),
            self.last_gb_s,
        )


class KVConnector(ABC):
    """One worker's end of KV transfers with any number of peers. All methods are thread-safe and
    return promptly: the work happens on the connector's own threads (or inline, for the fake)."""

    layout: KVLayout

    @abstractmethod
    def start_send(self, req: TransferRequest, cache: KVCache) -> None:
        """Register a send. Layers go out as `send_layer` announces them."""

    @abstractmethod
    def send_layer(self, transfer_id: str, layer: int) -> None:
        """Layer `layer` of the source blocks is final in `cache`; send it. Layers may be
        announced in any order, each once; after the transfer ended this does nothing."""

    @abstractmethod
    def start_recv(self, req: TransferRequest, cache: KVCache) -> None:
        """Register a receive into `req.dst_block_ids` of `cache`."""

    @abstractmethod
    def poll(self, transfer_id: str) -> TransferStatus:
        """The current status; ends the transfer FAILED (TIMEOUT) once its deadline has passed."""

    @abstractmethod
    def result(self, transfer_id: str) -> TransferResult | None:
        """The outcome once DONE or FAILED, else None."""

    @abstractmethod
    def wait(self, transfer_id: str, timeout_s: float) -> TransferStatus:
        """Block until the transfer ends or `timeout_s` passes; returns the status then."""

    @abstractmethod
    def abort(self, transfer_id: str) -> None:
        """End the transfer FAILED (ABORTED) and tell the peer. Returns once this side's blocks
        are no longer touched. Does nothing to a finished transfer."""

    @abstractmethod
    def release(self, transfer_id: str) -> None:
        """Forget a finished transfer. Raises on one still running (abort it first)."""

    @abstractmethod
    def stats(self) -> TransferStats:
        """A copy of the totals."""

    @abstractmethod
    def close(self) -> None:
        """Fail every running transfer (ABORTED) and drop all peers."""


def send_all_layers(connector: KVConnector, req: TransferRequest, cache: KVCache) -> None:
    """Start a send whose KV is already complete: every layer is announced at once."""
    connector.start_send(req, cache)
    for layer in range(req.num_layers):
        connector.send_layer(req.transfer_id, layer)
