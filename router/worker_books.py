"""One worker's books: what the router has placed there and not yet seen finish, prefills
queued (how far each has come, from the polls) and requests decoding, with their ITL SLOs and the
kind of placement each came by. WorkerState (router/pool_state.py) adds the polled load, the
prefix index and the step-time model's upkeep.

The router is the only one handing work to the pools, so its books are exact and current for
what it placed (a poll would be a step late); the polled load adds what only the worker knows
(KV usage, preemptions, its step times, how far each prefill has come).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from router.cost_model import StepTimeModel, prefill_pairs
from router.measured_gaps import MeasuredGaps


@dataclass(slots=True)
class _Prefill:
    tokens: int
    pairs: float
    local: bool = False  # the request decodes here too
    itl_slo_s: float = float("inf")  # ... and its ITL SLO (inf: none, or it can no longer attain)
    # of its tokens, those the worker had computed at the latest poll (WorkerState.absorb,
    # router/pool_state.py)
    done: int = 0
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


class WorkerBooks:
    """What the router placed on one worker. `model` prices a prompt's wait for the decodes
    booked here; `measured` gives each decode's ITL bias."""

    def __init__(self, model: StepTimeModel, measured: MeasuredGaps) -> None:
        self.model = model
        # What its requests measured: gaps, tails, prediction errors (router/measured_gaps.py).
        self.measured = measured
        self._prefills: dict[str, _Prefill] = {}
        self._decodes: dict[str, _Decode] = {}
        # (time.monotonic(), tokens, pairs) of the latest prefills placed here.
        self._placed: deque[tuple[float, int, float]] = deque(maxlen=256)

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
        computed of them at the latest poll (WorkerState.absorb, router/pool_state.py)."""
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

    def progress(self, left: Sequence[tuple[str, int]]) -> None:
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
