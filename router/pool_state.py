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

import numpy as np

from engine.prefix_hash import max_cacheable_tokens
from router.cost_model import StepTimeModel, prefill_pairs
from router.host_share import HostShare, PeerWork
from router.spread import PredictionBias, PredictionSpread
from router.vocab import PLACEMENT_KINDS
from worker_protocol.messages import WorkerInfo, WorkerLoad

# gap_factor: measured once this many gaps and decode steps fall in one window; within [1, this].
MIN_GAP_FACTOR_SAMPLES = 20
MAX_GAP_FACTOR = 4.0


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
    (WorkerState.itl_bias_factor): what its predicted p99 gap is multiplied by."""

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
        # (time.monotonic(), gap) of the latest inter-token gaps its requests saw at the router.
        self._gaps: deque[tuple[float, float]] = deque(maxlen=4096)
        # (time.monotonic(), p99 gap / median gap) of the latest requests that ended here.
        self._request_tails: deque[tuple[float, float]] = deque(maxlen=256)
        # (time.monotonic(), tokens, pairs) of the latest prefills placed here.
        self._placed: deque[tuple[float, int, float]] = deque(maxlen=256)
        # How far the p99 gaps predicted for its requests came from those measured: the width of
        # their ITL miss chances (router/predictions.py).
        self.itl_spread = PredictionSpread()
        # How many times their predictions the p99 gaps of its requests have come, by whether
        # they prefilled here (colocated) or their KV came from a peer (router/spread.py); and
        # the factors, as of the last update_tail().
        self.itl_bias = {local: PredictionBias() for _, local in PLACEMENT_KINDS}
        self._itl_bias_factor = dict.fromkeys(self.itl_bias, 1.0)
        self._tail = 1.0  # gap_tail(), as of the last update_tail()
        self._typical_gap = 0.0  # typical_gap(), likewise
        # (time.monotonic(), seconds, decodes) of the latest steps it ran with decodes in them.
        self._decode_steps: deque[tuple[float, float, int]] = deque(maxlen=4096)
        self._gap_factor: float | None = None  # gap_factor() as measured here (None: not yet)
        # What the deployment's other workers measured, for a worker that has not yet (set by
        # router/membership.py; 1: none has).
        self.peers_gap_factor = 1.0

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
        f = self._itl_bias_factor
        return [
            ItlCheck(d.itl_slo_s, f[d.local])
            for d in self._decodes.values()
            if d.itl_slo_s != float("inf")
        ]

    def coming_itl_checks(self) -> list[ItlCheck]:
        """As itl_checks, for the requests to decode here once their local prefill is done
        (coming_itl_slos): colocated, all of them."""
        return [ItlCheck(slo, self._itl_bias_factor[True]) for slo in self.coming_itl_slos()]

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

    def observe_gaps(self, gaps: Sequence[float], now: float | None = None) -> None:
        """Inter-token gaps a request decoding here just saw (measured at the router)."""
        t = time.monotonic() if now is None else now
        self._gaps.extend((t, g) for g in gaps)

    def recent_gaps(self, since: float) -> list[float]:
        return [g for t, g in self._gaps if t >= since]

    def observe_request(
        self,
        gaps: Sequence[float],
        predicted_p99_s: float = 0.0,
        slo_s: float = float("inf"),
        now: float | None = None,
        local: bool | None = None,
        raw_p99_s: float = 0.0,
    ) -> None:
        """The gaps of a request that decoded here, all of them, as it ends (at least 10), and
        the p99 gap predicted at its placement against its ITL SLO (0, inf: none); `local`:
        whether it prefilled here (None: neither kind's bias learns from it), `raw_p99_s` that
        prediction before the bias of its kind (itl_bias_factor)."""
        if len(gaps) >= 10:
            p50, p99 = np.percentile(gaps, [50, 99])
            self.itl_spread.observe(predicted_p99_s, float(p99), slo_s)
            if local is not None:
                self.itl_bias[local].observe(raw_p99_s, float(p99), now)
            if p50 > 0:
                t = time.monotonic() if now is None else now
                self._request_tails.append((t, float(p99 / p50)))

    def gap_tail(self) -> float:
        """How much longer a request's slow gaps are than its typical one (see update_tail): a
        request's ITL SLO holds its p99 gap, while the step-time model predicts the typical
        step."""
        return self._tail

    def itl_bias_factor(self, local: bool) -> float:
        """How many times their predicted p99 gap the requests that prefilled here (`local`) or
        whose KV came from a peer have seen lately; with too few of that kind, all of its
        requests (see update_tail)."""
        return self._itl_bias_factor[local]

    def typical_gap(self) -> float:
        """The median of the recent gaps its requests saw (0 with too few; see update_tail): a
        floor under the predicted step of a request decoding here. The step-time model knows
        the decode batch; what else runs in the worker's steps (prefill chunks, its own or a
        peer's, at up to its step target, one after another while prompts keep coming) shows
        here."""
        return self._typical_gap

    def update_tail(
        self,
        window_s: float = 30.0,
        min_gaps: int = 50,
        requests_window_s: float = 120.0,
        min_requests: int = 8,
    ) -> None:
        """The tail, in [1, 4]: the median over the requests that ended here in the last
        `requests_window_s` of each one's p99 gap over its median gap; until `min_requests`
        have, the p99 of the last `window_s` of all gaps over their median (which overstates
        it: slow moments of the worker fall on a few requests, not on each one's p99); 1 with
        fewer than `min_gaps` gaps. And the median gap of that window (0 with too few), and the
        bias of each kind of p99 gap prediction. Once per load poll: every candidate of every
        decision reads them."""
        now = time.monotonic()
        gaps = self.recent_gaps(now - window_s)
        tail, typical = 1.0, 0.0
        if len(gaps) >= min_gaps:
            p50, p99 = np.percentile(gaps, [50, 99])
            tail = float(p99 / p50) if p50 > 0 else 1.0
            typical = float(p50)
        ratios = [r for t, r in self._request_tails if t >= now - requests_window_s]
        if len(ratios) >= min_requests:
            tail = float(np.median(ratios))
        self._tail, self._typical_gap = min(4.0, max(1.0, tail)), typical
        # A kind with too few checks of its own (a few of its own count among the others')
        # takes the worker's, over all kinds (1 with too few of those): both decode in the
        # same steps. At 1, a kind not taken lately reads as predicted where the other has
        # come late, and the untried placement looks the better one. In run cal at 1.0 req/s
        # (mixed, a7b9eb7), auto colocated 8 requests of 30 on the split's decode worker, each
        # read to miss its own ITL SLO less than handed off to the same worker (0.64-0.79
        # against 0.84-0.90; that the kinds' biases made the difference is inferred, those
        # records do not show them), and 25 of the 30 missed their ITL SLO (4 under the split).
        first, *rest = self.itl_bias.values()
        pooled = first.pooled(rest, now)
        self._itl_bias_factor = {k: b.factor(now, pooled) for k, b in self.itl_bias.items()}
        # A step with n decodes gives n gaps: the steps weigh as many.
        recent = [(s, n) for t, s, n in self._decode_steps if t >= now - window_s]
        if min(len(gaps), len(recent)) >= MIN_GAP_FACTOR_SAMPLES:
            step = float(np.median(np.repeat([s for s, _ in recent], [n for _, n in recent])))
            if step > 0:
                factor = float(np.median(gaps)) / step
                self._gap_factor = min(MAX_GAP_FACTOR, max(1.0, factor))

    def gap_factor(self) -> float:
        """How much longer the gaps its requests see at the router are than the steps it runs
        (the median of each over the last window with enough of both, each step weighed by its
        decodes, one gap each): a step is the model's forward pass, a gap also its way out of
        the engine and to the router. The step-time model predicts steps; an ITL SLO holds gaps.
        It holds once measured (a property of the worker's process and transport, not of its
        load), and until then is what the deployment's other workers measured
        (`peers_gap_factor`)."""
        return self._gap_factor if self._gap_factor is not None else self.peers_gap_factor

    @property
    def measured_gap_factor(self) -> float | None:
        return self._gap_factor

    def carry(self, old: WorkerState) -> None:
        """What a replacement of `old` keeps (the same model on the same kind of device, in the
        same process and transport): how far its predictions erred, their bias per kind of
        placement, in force from its first placement on, and its measured gaps over steps until
        it has its own."""
        self.itl_spread, self.itl_bias = old.itl_spread, old.itl_bias
        self._itl_bias_factor = dict(old._itl_bias_factor)
        self._gap_factor = old.measured_gap_factor

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
        self._decode_steps.extend(
            (now, s.seconds, s.decode_seqs) for s in load.steps if s.decode_seqs
        )
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
