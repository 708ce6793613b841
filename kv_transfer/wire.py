"""The messages one lane of a pair carries (see torch_dist.py for the ordering rule).

Every message is a fixed-size int64 header on HEADER_TAG; a LAYER header is followed by exactly one
data message, the blocks of one or more consecutive layers as one contiguous tensor (gathered, or
for one layer whose blocks are one run, the cache slice itself), on `data_tag(seq)`:

    header int64[10]: kind | seq | tid_hash | num_blocks | num_layers | layer | nbytes
                      | deadline_ms | reason | checksum

    START      seq, tid_hash, num_blocks, num_layers, deadline_ms   a send begins
    LAYER      seq, layer, num_layers, num_blocks, nbytes, checksum   data of layers [layer,
               layer + num_layers) follows, layer-major: num_layers * num_blocks block-layers;
               checksum(data) when the sender checks, else 0 (the receiver then checks nothing)
    ABORT      seq, tid_hash, reason        the sender ended it early; no more layers of seq
    PEER_FAIL  tid_hash, reason             the receiver ended it; the sender should stop
    ACK        tid_hash                     the receiver holds every layer
    HEARTBEAT                               the lane is alive while idle
    CLOSE                                   the sender of this lane is going away
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import torch

from kv_transfer.base import FailureReason

HEADER_TAG = 0
HEADER_LEN = 10
NO_CHECKSUM = 0
_REASONS = list(FailureReason)


class Kind(enum.IntEnum):
    START = 1
    LAYER = 2
    ABORT = 3
    PEER_FAIL = 4
    ACK = 5
    HEARTBEAT = 6
    CLOSE = 7


def data_tag(seq: int) -> int:
    """Unique per transfer on a lane (modulo 2**30), never HEADER_TAG."""
    return 1 + seq % (1 << 30)


def tid_hash(transfer_id: str) -> int:
    """A stable 63-bit hash of a transfer id (both processes must agree; not Python's hash)."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    seq: int = 0
    tid_hash: int = 0
    num_blocks: int = 0
    num_layers: int = 0
    layer: int = 0
    nbytes: int = 0
    deadline_ms: int = 0
    reason: FailureReason | None = None
    checksum: int = NO_CHECKSUM

    def encode(self, out: torch.Tensor) -> torch.Tensor:
        """Write into `out` (int64[HEADER_LEN], any device) and return it."""
        reason = -1 if self.reason is None else _REASONS.index(self.reason)
        values = [
            int(self.kind),
            self.seq,
            self.tid_hash,
            self.num_blocks,
            self.num_layers,
            self.layer,
            self.nbytes,
            self.deadline_ms,
            reason,
            self.checksum,
        ]
        out.copy_(torch.tensor(values, dtype=torch.int64))
        return out

    @classmethod
    def decode(cls, buf: torch.Tensor) -> Header:
        v = buf.tolist()
        reason = None if v[8] < 0 else _REASONS[v[8]]
        return cls(Kind(v[0]), v[1], v[2], v[3], v[4], v[5], v[6], v[7], reason, v[9])


def checksum(data: torch.Tensor) -> int:
    """A per-message checksum of the bytes in `data` (contiguous, any device): the wrapping sum
    of its 64-bit words (of its bytes, for a size that is not a multiple of 8), as a 63-bit
    number, never NO_CHECKSUM. One pass over memory at memory speed (an int32 view summed into
    int64 measured 50x slower on CPU): it catches flipped or lost bits, not an adversary."""
    flat = data.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes % 8 == 0:
        total = int(flat.view(torch.int64).sum())
    else:
        total = int(flat.view(torch.uint8).sum(dtype=torch.int64))
    return (total & ((1 << 63) - 1)) or 1
