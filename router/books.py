"""One admitted request's books, from admission to its end: opened as it is admitted and settled
in one place whichever way it ends (finished, failed, cancelled by its client or its deadline,
or after resuming on another decode worker when its own died).

What they hold:
  - the core's counts: requests waiting for their first token (pending) and not yet finished
    (active), and how many times one moved to another decode worker (resumed);
  - the request's entries in the books of every worker it was placed on (router/worker_books.py):
    queued prefill, then decoding, grown by each token, out when the placement ends;
  - its DecisionRecord when no token ever came (one with its TTFT is kept by the core when the
    first token comes);
  - its RequestRecord for the stats sink, failed unless it ended or its client left.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from router.core_types import DecisionRecord
from router.cost_model import prefill_pairs
from router.policy import Decision, PathPrediction, RequestShape
from router.pool_state import WorkerState
from router.stats import StatsSink
from router.tracker import Tracker
from router.vocab import FinishReason, RoutePath
from worker_protocol.messages import TokenChunk


@dataclass(slots=True)
class RequestCounts:
    pending: int = 0  # admitted, waiting for their first token
    active: int = 0  # admitted, not yet finished
    resumed: int = 0  # times a request moved to another decode worker


class RequestBooks:
    """A context manager: entering counts the request in; leaving settles everything it holds.
    Between the two, `place` enters each placement, `took` books each chunk and `moved` takes a
    placement whose decode worker died out again."""

    def __init__(
        self,
        wid: str,
        track: Tracker,
        first: Decision,
        counts: RequestCounts,
        records: deque[DecisionRecord],
        states: Mapping[str, WorkerState],
        sink: StatsSink,
    ) -> None:
        self.wid = wid  # the id the workers know its current placement by
        self._first_wid = wid
        self.track = track
        self.first = first  # the decision the client is told about
        self.counts = counts
        self.records = records
        self.states = states
        self.sink = sink
        self.emitted: list[int] = []  # tokens streamed so far, over every placement
        self.placed: list[WorkerState] = []
        self.ended = False  # its last chunk is out
        self._resumed_gap = False  # the next gap spans a resume (not charged to a worker)
        self.shape: RequestShape | None = None  # of the current placement
        self.p: WorkerState | None = None  # the worker that prefills it now
        self.d: WorkerState | None = None  # its decode worker now
        self.chosen: PathPrediction | None = None  # the current placement's prediction

    def __enter__(self) -> RequestBooks:
        self.counts.pending += 1
        self.counts.active += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The client left (or its deadline passed): an abort, not a failure.
        left = exc_type is not None and issubclass(
            exc_type, (GeneratorExit, asyncio.CancelledError)
        )
        if self.track.first_at is None:
            self.counts.pending -= 1
            self.records.append(DecisionRecord(self.track.request_id, self.first, None))
        self.counts.active -= 1
        for w in self.placed:
            w.finish(self.wid)
        self.sink.finished(self.track.record(failed=not (self.ended or left)))
        # Of its last placement, as its answer says them (RequestBooks.moved forgets the others).
        if self.track.kv_fallback is not None:
            self.sink.fell_back(self.track.kv_fallback.value)
        if self.track.replanned_to is not None:
            self.sink.replanned()

    def place(self, shape: RequestShape, chosen: PathPrediction) -> tuple[WorkerState, WorkerState]:
        """Enter a placement: (the worker that prefills it, its decode worker). A disaggregated
        request counts on its decode worker at once (its blocks are reserved there first); a
        colocated one, once its first token is out (a request of one token never: it has ended
        by then)."""
        d = self.states[chosen.decode_worker]
        p = self.states.get(chosen.prefill_worker) or d
        self.shape, self.p, self.d, self.chosen = shape, p, d, chosen
        self.track.path = chosen.path.value  # a resumed request's metrics go by where it went on
        self.placed += [p, d]
        hit = p.cached_tokens(shape.hashes, shape.prompt_len)
        n_prefill = shape.prompt_len - hit
        p.add_prefill(
            self.wid,
            n_prefill,
            prefill_pairs(n_prefill, hit),
            local=p is d and shape.decodes,  # one token: it decodes nowhere
            itl_slo_s=shape.slo_itl_s,
        )
        self.sink.prefill_placed(p.worker_id, p.info.role.value, for_peer=p is not d)
        if p is not d:  # its blocks and slot there (one token: it guards no ITL)
            slo = shape.slo_itl_s if shape.decodes else float("inf")
            d.add_decode(self.wid, shape.prompt_len, slo, local=False, left=shape.max_tokens)
        p.prefix.insert(shape.hashes)
        d.prefix.insert(shape.hashes)
        if self.late:  # resumed after missing its TTFT SLO
            d.unprotect(self.wid)
        return p, d

    def took(self, chunk: TokenChunk) -> bool:
        """Book a chunk of the current placement; True when it brings the very first token."""
        assert self.d is not None, "a chunk before any placement"
        n = len(chunk.token_ids)
        if n:
            self._decoding()
        was_first = self.track.first_at is None
        gaps = self.track.chunk(chunk)
        if n:
            self.sink.streamed(self.track.path, n, gaps)
            if self._resumed_gap:  # death, detection and re-prefill: not the new worker's step
                self._resumed_gap = False
            else:
                self.d.measured.observe_gaps(gaps)
        first = was_first and self.track.first_at is not None
        if first:
            self.counts.pending -= 1
            if self.late:
                self.d.unprotect(self.wid)  # it cannot attain: it guards no one's ITL
        self.emitted.extend(chunk.token_ids)
        self.d.grow(self.wid, n)
        return first

    def _decoding(self) -> None:
        """Tokens came: the decode worker's prefill of it (if any) is over."""
        p, d, wid = self.p, self.d, self.wid
        assert d is not None and self.shape is not None
        if p is d and not d.decoding(wid):
            d.done(wid)  # colocated: prefilled here; decoding from now on (one token: ended)
            shape = self.shape
            if not shape.decodes:
                return
            d.add_decode(wid, shape.prompt_len, shape.slo_itl_s, local=True, left=shape.max_tokens)
            if self.late:  # resumed after missing its TTFT SLO
                d.unprotect(wid)
        elif d.prefilling(wid):
            d.done(wid)  # a disaggregated request prefilled here after a fallback

    def finished(
        self,
        reason: FinishReason | None,
        cached_prompt_tokens: int,
        length_reason: str | None = None,
    ) -> None:
        """Its last chunk is about to go out; a request that decoded on one worker throughout
        tells that worker's tail what its gaps were, and its spread and the bias of its kind
        (prefilled there, or its KV from the prefill worker: not one that fell back to a prefill
        on the decode worker or was replanned) how they came against the p99 gap predicted at
        its placement, where that prediction is one to check (PathPrediction.itl_checkable)."""
        self.track.ended(reason, cached_prompt_tokens, length_reason)
        self.ended = True
        d, c, shape = self.d, self.chosen, self.shape  # set together by `place`
        if d is not None and c is not None and shape is not None and not self.track.resumed:
            if not c.itl_checkable:
                d.measured.observe_request(self.track.itl_s)  # its tail only
                return
            local = c.path is RoutePath.COLOCATED
            kind = None if self.track.kv_fallback or self.track.replanned_to else local
            d.measured.observe_request(
                self.track.itl_s,
                c.itl_p99_s,
                shape.slo_itl_s,
                local=kind,
                raw_p99_s=c.raw_itl_p99_s,
            )

    def moved(self) -> None:
        """Its decode worker was lost: the placement leaves the books (so that the next
        decision sees it gone), and the request counts as resumed. The next placement goes by a
        new id: the old one was aborted for good on the workers that outlived it, which then
        ignore a call for it (worker_protocol/ended.py)."""
        for w in (self.p, self.d):
            if w is not None:
                w.finish(self.wid)
        self.track.resumed += 1
        self.track.kv_fallback = self.track.replanned_to = None  # of the placement it leaves
        self.track.prefiller_cached = None
        self.counts.resumed += 1
        self.sink.moved()
        self._resumed_gap = True
        self.wid = f"{self._first_wid}/{self.track.resumed}"

    @property
    def late(self) -> bool:
        """The first token came after the TTFT SLO: the request can no longer attain."""
        ttft = self.track.ttft_s
        return ttft is not None and self.shape is not None and ttft > self.shape.slo_ttft_s
