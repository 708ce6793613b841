"""The router's own view of each worker: what it has sent there and not yet seen finish, which
prompt prefixes the worker should hold in its prefix cache, its last polled load, and its
step-time model.

The router is the only one handing work to the pools, so its books are exact and current for
what it placed (a poll would be a step late); the polled load adds what only the worker knows
(KV usage, preemptions, its step times, how far each prefill has come).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.prefix_hash import max_cacheable_tokens
from router.cost_model import StepTimeModel, prefill_pairs
from router.host_share import HostShare, PeerWork
from router.measured_gaps import MeasuredGaps
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


@dataclass(slots=True)
class _Prefill:
    tokens: int
    pairs: float
    local: bool = False  # the request decodes here too
    itl_slo_s: float = float("inf")  # ... and its ITL SLO (inf: none, or it can no longer attain)
    done: int = 0  # of its tokens, those the worker had computed at the latest poll (absorb)
    seen: bool = False  # a poll found it at the worker

    @property
    def left(self) -> int:
        return self.tokens - self.done

    @property
    def pairs_left(self) -> float:
        """Its attention pairs still to compute: those of its last `left` tokens, after the
        prefix it was placed with (read back from its pairs: prefill_pairs) and what is done."""
        if not self.done:
            return self.pairs
        cached = max(0, round(self.pairs / self.tokens - (self.tokens + 1) / 2))
        return prefill_pairs(self.left, cached + self.done)


@dataclass(slots=True)
class _Decode:
    context: int
    itl_slo_s: float
    local: bool  # prefilled here (colocated), not its KV from a peer
    left: int = 0  # tokens it may still decode (max_tokens less those come; 0: unknown)


class Queued(NamedTuple):
    """A prefill queued on a worker: its prompt tokens and attention pairs still to compute,
    and the context it decodes there with from its first token on (its prompt past a prefix
    hit, short by the hit, as coming_context; 0 where its KV goes to a peer)."""

    left: int
    pairs_left: float
    decodes_with: int


class ItlCheck(NamedTuple):
    """A request's ITL SLO, and the bias of its kind of placement on its decode worker
    (MeasuredGaps.itl_bias_factor): what its predicted p99 gap is multiplied by."""

    slo_s: float
    bias: float


class WorkerState:
    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.worker_id = info.worker_id
        self.model = StepTimeModel(info)
        # How much slower steps run on its node while a peer there is busy: one per node, shared
        # by its workers (router/membership.py).
        self.host = HostShare()
        self.prefix = PrefixIndex(info.num_blocks)
        self._prefills: dict[str, _Prefill] = {}
        self._decodes: dict[str, _Decode] = {}
        self.load: WorkerLoad | None = None
        # (time.monotonic(), tokens, pairs) of the latest prefills placed here.
        self._placed: deque[tuple[float, int, float]] = deque(maxlen=256)
        # What its requests measured: gaps, tails, prediction errors (router/measured_gaps.py).
        self.measured = MeasuredGaps()

    # -- what the router placed here -----------------------------------------------------------
    def add_prefill(
        self,
        rid: str,
        tokens: int,
        pairs: float,
        local: bool = False,
        itl_slo_s: float = float("inf"),
    ) -> None:
        """`local`: the request decodes here too (colocated), with ITL SLO `itl_slo_s`."""
        self._prefills[rid] = _Prefill(tokens, pairs, local, itl_slo_s if local else float("inf"))
        self._placed.append((time.monotonic(), tokens, pairs))

    def recent_prefills(self, window_s: float) -> list[tuple[int, float]]:
        """(tokens, pairs) of the prefills placed here in the last `window_s`."""
        since = time.monotonic() - window_s
        return [(n, pairs) for at, n, pairs in self._placed if at >= since and n > 0]

    def add_decode(
        self, rid: str, context: int, itl_slo_s: float, *, local: bool, left: int = 0
    ) -> None:
        """`local`: it prefilled here (colocated); else its KV came from a peer (a handoff that
        fell back to a prefill here stays one: priced as the handoffs here come). `left`: the
        tokens it may decode (its max_tokens; 0: unknown)."""
        self._decodes[rid] = _Decode(context, itl_slo_s, local, left)
        self._decodes_changed()

    def _decodes_changed(self) -> None:
        """The model prices a prompt's wait for the decodes by the longest of them (0: one of
        unknown length, which no wait is priced for)."""
        if self.model.hold_s is None:
            return  # the worker never holds prompts: nothing to price
        lefts = [d.left for d in self._decodes.values()]
        self.model.decode_left = 0 if not lefts or 0 in lefts else max(lefts)

    def unprotect(self, rid: str) -> None:
        """`rid` is past its TTFT SLO and can no longer attain: its ITL SLO stops guarding
        what may run beside it (auto's ITL guard protects the requests that can still attain)."""
        for held in (self._decodes.get(rid), self._prefills.get(rid)):
            if held is not None:
                held.itl_slo_s = float("inf")

    def prefilling(self, rid: str) -> bool:
        return rid in self._prefills

    def decoding(self, rid: str) -> bool:
        return rid in self._decodes

    def grow(self, rid: str, tokens: int) -> None:
        d = self._decodes.get(rid)
        if d is not None:
            d.context += tokens
            if d.left:
                d.left = max(1, d.left - tokens)
                self._decodes_changed()

    def done(self, rid: str) -> None:
        """Forget `rid`'s prefill (its first token came or it ended)."""
        self._prefills.pop(rid, None)

    def finish(self, rid: str) -> None:
        self._prefills.pop(rid, None)
        if self._decodes.pop(rid, None) is not None:
            self._decodes_changed()

    @property
    def queued_prefills(self) -> int:
        return len(self._prefills)

    @property
    def local_prefills(self) -> int:
        """Prefills queued here for requests that decode here too: decodes to come."""
        return sum(1 for p in self._prefills.values() if p.local)

    @property
    def queued_tokens(self) -> int:
        """The prompt tokens still to compute here: those placed, less what the worker had
        computed of them at the latest poll (see absorb)."""
        return sum(p.left for p in self._prefills.values())

    @property
    def queued_pairs(self) -> float:
        return sum(p.pairs_left for p in self._prefills.values())

    def queued(self) -> list[Queued]:
        """The prefills queued here, in the order placed."""
        return [
            Queued(p.left, p.pairs_left, p.tokens if p.local else 0)
            for p in self._prefills.values()
        ]

    def _progress(self, left: Sequence[tuple[str, int]]) -> None:
        """How far the prefills placed here have come, from a poll's (request id, prompt tokens
        still to compute) of each request waiting or prefilling at the worker
        (WorkerLoad.prefills_left), read afresh at every poll (a preempted request starts over).
        One the poll does not hold has not reached the worker yet (none computed), or, if an
        earlier poll held it, is computed (one token left until its first token comes); one
        held with more than the books count (a prefix they took as cached, waiting) has none
        computed. Without it, a prompt placed behind one nearly done was predicted to wait that
        one's whole prefill: on long-prompt (2-core CPU host, one prefill worker), first tokens
        predicted behind a queue came at 0.4-0.9x their prediction, and admission refused
        requests that would have attained."""
        at_worker = dict(left)
        for rid, p in self._prefills.items():
            n = at_worker.get(rid)
            if n is not None:
                p.seen = True
                p.done = max(0, min(p.tokens - n, p.tokens - 1))
            elif p.seen:
                p.done = max(0, p.tokens - 1)

    @property
    def busy(self) -> bool:
        """Whether it has anything the router placed there: prefills, decodes (a handoff's from
        its placement on: its blocks are reserved and its KV on its way)."""
        return bool(self._prefills or self._decodes)

    @property
    def batch(self) -> int:
        return len(self._decodes)

    @property
    def context(self) -> int:
        return sum(d.context for d in self._decodes.values())

    def itl_slos(self) -> list[float]:
        """The ITL SLOs of the requests decoding here that can still attain."""
        return [c.slo_s for c in self.itl_checks()]

    def itl_checks(self) -> list[ItlCheck]:
        """The requests decoding here that can still attain: their ITL SLOs, with the bias of
        each one's kind of placement here."""
        f = self.measured.itl_bias_factor
        return [
            ItlCheck(d.itl_slo_s, f(d.local))
            for d in self._decodes.values()
            if d.itl_slo_s != float("inf")
        ]

    def coming_itl_checks(self) -> list[ItlCheck]:
        """As itl_checks, for the requests to decode here once their local prefill is done
        (coming_itl_slos): colocated, all of them."""
        return [
            ItlCheck(slo, self.measured.itl_bias_factor(True)) for slo in self.coming_itl_slos()
        ]

    def coming_itl_slos(self) -> list[float]:
        """The ITL SLOs of the requests to decode here once their local prefill, queued here,
        is done (colocated: counted as decoding only from their first token), that can still
        attain. A prefill placed here after theirs runs its chunks beside their decodes."""
        return [p.itl_slo_s for p in self._prefills.values() if p.itl_slo_s != float("inf")]

    @property
    def coming_context(self) -> int:
        """The tokens the local prefills queued here compute (their prompts past a prefix-cache
        hit): about the context they decode with, short by the hit."""
        return sum(p.tokens for p in self._prefills.values() if p.local)

    @property
    def min_itl_slo_s(self) -> float:
        """The tightest ITL SLO among the requests decoding here that can still attain (inf when
        none)."""
        return min((d.itl_slo_s for d in self._decodes.values()), default=float("inf"))

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
        self._progress(load.prefills_left)
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
