"""What the request core learns from one disaggregated placement's handoff (a HandoffListener):
the prefill worker's measured times and transfer, or a fallback to a local prefill. It keeps the
books of the very workers the request was placed on (a replacement under the same id has books of
its own), trains the transfer model and the pair's health, and reports to the stats sink."""

from __future__ import annotations

from router.cost_model import prefill_pairs
from router.handoff_model import HandoffHealth, TransferTimeModel
from router.policy import PathPrediction
from router.pool_state import WorkerState
from router.stats import StatsSink, TransferRecord
from router.tracker import Tracker
from router.vocab import FallbackReason
from worker_protocol.messages import PrefillResult


class Handoff:
    __slots__ = ("track", "wid", "chosen", "p", "d", "transfer", "health", "sink", "prefill_worker")

    def __init__(
        self,
        track: Tracker,
        wid: str,
        chosen: PathPrediction,
        p: WorkerState,
        d: WorkerState,
        transfer: TransferTimeModel,
        health: HandoffHealth,
        sink: StatsSink,
    ) -> None:
        self.track = track
        self.wid = wid
        self.chosen = chosen
        self.p = p  # the prefill worker's books (the decode worker's on the colocated path)
        self.d = d
        self.transfer = transfer
        self.health = health
        self.sink = sink
        self.prefill_worker = chosen.prefill_worker  # another one after a re-plan

    def prefilled(self, result: PrefillResult) -> None:
        self.track.prefilled(result)
        if result.first_token is not None and result.transfer_ok:
            self.track.prefiller_cached = result.num_cached_tokens
        if self.track.replanned_to is not None:  # its TTFT includes the dead worker's time:
            self.track.handed_off = False  # nothing to train the disaggregated path's bias on
        if self.p is not self.d:
            self.p.done(self.wid)  # its prefill is over; the decode worker has the request now
        if result.transfer_ok and result.bytes_sent > 0:
            self.transfer.observe(result.bytes_sent, result.transfer_s)
        if result.transfer_ok:
            self.health.observe(self.prefill_worker, self.chosen.decode_worker, ok=True)
        if result.bytes_sent > 0 or not result.transfer_ok:  # a send happened, or failed
            self.sink.transferred(
                TransferRecord(
                    result.bytes_sent, result.send_s, result.transfer_ok, result.failure_reason
                )
            )

    def fell_back(self, reason: FallbackReason, detail: str, wasted_s: float) -> None:
        """The decode worker prefills the request itself: its prefill moves to the decode
        worker's books (until its first token), and the pair's health learns the failure (not
        when the decode worker only had no room to reserve: that says nothing of the pair). The
        fallback is counted as the request ends, unless it resumed elsewhere meanwhile (its
        decode worker lost: RequestBooks.moved): the metric says what the answers say."""
        if self.track.kv_fallback is None:
            self.track.kv_fallback = reason
        self.track.prefiller_cached = None  # the decode worker's own hit, then
        # Its first token comes from the decode worker's own prefill: that is the TTFT's story
        # (and no handoff to train the disaggregated path's bias on).
        self.track.handed_off = False
        if self.p is not self.d:
            self.p.done(self.wid)
        n = self.track.prompt_tokens
        if not self.d.prefilling(self.wid):
            self.d.add_prefill(self.wid, n, prefill_pairs(n, 0))
        if reason is not FallbackReason.NO_RESERVATION:  # a full decode worker, not the pair
            self.health.observe(self.prefill_worker, self.chosen.decode_worker, False, wasted_s)

    def replanned(self, dead: str, to: str, detail: str, wasted_s: float) -> None:
        """Its prefill worker died: the pair's health learns the failure and the prefill leaves
        the dead worker's books (the new one's do not count it: a rare, short stay)."""
        if self.p is not self.d:
            self.p.done(self.wid)
        self.health.observe(dead, self.chosen.decode_worker, False, wasted_s)
        self.prefill_worker = self.track.replanned_to = to  # counted as it ends (books)
