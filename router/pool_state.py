"""The router's own view of each worker: its books of what the router has sent there and not
yet seen finish (router/worker_books.py), which prompt prefixes the worker should hold in its
prefix cache, its last polled load, and its step-time model, which the polls train.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from engine.prefix_hash import max_cacheable_tokens
from router.cost_model import StepTimeModel
from router.host_share import HostShare, PeerWork
from router.measured_gaps import MeasuredGaps
from router.worker_books import WorkerBooks
from worker_protocol.messages import WorkerInfo, WorkerLoad


class PrefixIndex:
    """The block hashes a worker's prefix cache should hold, least recently used first, at most
    as many as the worker has blocks. An estimate: the worker may have evicted some sooner."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading hashes are held."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


class WorkerState(WorkerBooks):
    def __init__(self, info: WorkerInfo) -> None:
        super().__init__(StepTimeModel(info), MeasuredGaps())
        self.info = info
        self.worker_id = info.worker_id
        # How much slower steps run on its node while a peer there is busy: one per node, shared
        # by its workers (router/membership.py).
        self.host = HostShare()
        self.prefix = PrefixIndex(info.num_blocks)
        self.load: WorkerLoad | None = None

    def carry(self, old: WorkerState) -> None:
        """What a replacement of `old` keeps (the same model on the same kind of device, in the
        same process and transport): how far its predictions erred, their bias per kind of
        placement, in force from its first placement on, and its measured gaps over steps until
        it has its own."""
        self.measured.carry(old.measured)

    # -- what the worker knows ------------------------------------------------------------------
    def cached_tokens(self, hashes: Sequence[bytes], prompt_len: int) -> int:
        held = self.prefix.match(hashes) * self.info.block_size
        return min(held, max_cacheable_tokens(prompt_len, self.info.block_size))

    def absorb(self, load: WorkerLoad, peer: PeerWork = PeerWork.IDLE) -> None:
        """Its polled load; `peer`: the work its peers on the node ran at the poll (its steps
        since the last one then ran HostShare.factor(peer) times slower, which the model learns
        them without)."""
        self.load = load
        self.model.chunk_floor_s = load.chunk_floor_s
        self.model.hold_left_s = load.hold_left_s
        now = time.monotonic()
        self.progress(load.prefills_left)
        self.measured.observe_steps(load.steps, now)
        if load.steps and self.model.settled:
            for s, alone in zip(load.steps, self.model.alone_s(load.steps), strict=True):
                self.host.observe(
                    self.worker_id, self.info.incarnation, float(alone), s.seconds, peer
                )
        scale = self.host.factor(peer)
        for s in load.steps:
            self.model.observe(s, scale)
        self.set_peer_work(peer)

    def set_peer_work(self, peer: PeerWork) -> None:
        """What its peers on the node run now: its predicted steps carry the node's share for
        that."""
        self.model.set_scale(self.host.factor(peer))

    def shared_slowdown(self) -> float:
        """How much slower its steps would run with a peer on its node decoding than they run
        now."""
        return self.host.factor(PeerWork.DECODE) / self.model.scale

    @property
    def kv_usage(self) -> float:
        return self.load.kv_usage if self.load is not None else 0.0

    @property
    def load_score(self) -> float:
        """The larger of the books' active tokens over the KV capacity and the polled KV usage
        (the same tokens seen twice: the books are current, the poll sees everything)."""
        capacity = self.info.num_blocks * self.info.block_size
        return max((self.context + self.queued_tokens) / capacity, self.kv_usage)


def peer_work(w: WorkerState, workers: Sequence[WorkerState]) -> PeerWork:
    """The work the workers other than `w` on its node (among `workers`) have that slows its
    steps the most, by the node's share: decodes (a handoff's from its placement on) or
    prefills; none when they are idle. A worker whose node is unknown ("") shares it with
    none."""
    node = w.info.node_ip
    peers = [o for o in workers if o is not w and o.info.node_ip == node] if node else []
    kinds = [
        kind
        for kind, present in (
            (PeerWork.DECODE, any(o.batch for o in peers)),
            (PeerWork.PREFILL, any(o.queued_prefills for o in peers)),
        )
        if present
    ]
    return max(kinds, key=w.host.factor, default=PeerWork.IDLE)
