"""What the request core reports as it works, as plain records; the process edge (router/metrics.py)
turns them into Prometheus metrics. The core never touches a metric itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.host_share import PeerWork
from router.vocab import Frontend, RejectReason
from worker_protocol.messages import WorkerLoad, WorkerRole


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request that ran, measured at the router (one clock: time.monotonic())."""

    request_id: str
    path: str  # "colocated" | "disaggregated": the path chosen first
    frontend: Frontend  # the front door it came in by
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    ttft_s: float | None  # arrival at the router -> first token out of it; None: no token
    predicted_ttft_s: float
    itl_s: tuple[float, ...]  # gaps between consecutive output tokens
    e2e_s: float  # arrival -> last token (or the end)
    queue_s: float  # arrival on the worker that prefilled it -> first scheduled there
    prefill_s: float | None  # first scheduled -> first token on the prefilling worker
    resumed: int  # times it moved to another decode worker after its own died or left
    # What ended a "length" finish before max_tokens: kv_cache_capacity (its worker's KV cache
    # could not hold it). None: max_tokens, or another finish.
    length_reason: str | None = None


@dataclass(frozen=True, slots=True)
class FirstTokenRecord:
    """A request's first token left the router."""

    path: str  # the path chosen first
    frontend: Frontend
    ttft_s: float  # arrival at the router -> first token out of it
    queue_s: float  # on the worker that prefilled it: arrival -> first scheduled
    prefill_s: float | None  # first scheduled -> first token there
    predicted_ttft_s: float  # what the cost model said of the path taken


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One KV send, as the prefill worker reported it."""

    bytes: int
    seconds: float  # the connector's own: send started -> ended
    ok: bool
    reason: str | None  # a kv_transfer FailureReason value when not ok


class StatsSink(Protocol):
    def decided(self, path: str, reason: str) -> None: ...

    def rejected(self, reason: RejectReason, frontend: Frontend) -> None: ...

    def first_token(self, record: FirstTokenRecord) -> None: ...

    def streamed(self, path: str, tokens: int, gaps_s: Sequence[float]) -> None: ...

    def finished(self, record: RequestRecord) -> None: ...

    def transferred(self, record: TransferRecord) -> None: ...

    def loads(self, loads: Sequence[WorkerLoad]) -> None: ...

    def worker_lost(self, worker_id: str, role: str) -> None: ...

    def worker_hung(self, worker_id: str, role: str) -> None: ...

    def worker_removed(self, worker_id: str, role: str) -> None: ...

    def worker_restarted(self, role: str, times: int) -> None: ...

    def workers(self, ready: dict[WorkerRole, int]) -> None: ...

    def prefill_placed(self, worker_id: str, role: str, for_peer: bool) -> None: ...

    def decoding(self, running: dict[tuple[str, str], int]) -> None: ...

    def node_shares(self, shares: dict[tuple[str, PeerWork], float]) -> None: ...

    def spreads(self, widths: dict[tuple[str, str], float]) -> None:
        """(kind, worker) -> the spread of the router's predictions of that kind (ttft, with
        worker ""; itl_p99, per decode worker): router/spread.py."""

    def gap_factors(self, factors: dict[str, float]) -> None:
        """worker -> how much longer the gaps its requests see are than its steps
        (MeasuredGaps.gap_factor)."""

    def biases(self, factors: dict[tuple[str, str], float]) -> None:
        """(kind, worker) -> how many times their prediction the p99 gaps of the worker's
        requests of that kind (colocated, received) came lately; with too few of the kind, all
        the worker's requests (MeasuredGaps.itl_bias_factor)."""

    def fell_back(self, reason: str) -> None: ...

    def replanned(self) -> None: ...

    def moved(self) -> None:
        """A request left its lost decode worker to resume on another (counted as it moves)."""


class NullSink:
    """Records nothing (the core without metrics, e.g. in unit tests)."""

    def decided(self, path: str, reason: str) -> None:
        pass

    def rejected(self, reason: RejectReason, frontend: Frontend) -> None:
        pass

    def first_token(self, record: FirstTokenRecord) -> None:
        pass

    def streamed(self, path: str, tokens: int, gaps_s: Sequence[float]) -> None:
        pass

    def finished(self, record: RequestRecord) -> None:
        pass

    def transferred(self, record: TransferRecord) -> None:
        pass

    def loads(self, loads: Sequence[WorkerLoad]) -> None:
        pass

    def worker_lost(self, worker_id: str, role: str) -> None:
        pass

    def worker_hung(self, worker_id: str, role: str) -> None:
        pass

    def worker_removed(self, worker_id: str, role: str) -> None:
        pass

    def worker_restarted(self, role: str, times: int) -> None:
        pass

    def workers(self, ready: dict[WorkerRole, int]) -> None:
        pass

    def prefill_placed(self, worker_id: str, role: str, for_peer: bool) -> None:
        pass

    def decoding(self, running: dict[tuple[str, str], int]) -> None:
        pass

    def node_shares(self, shares: dict[tuple[str, PeerWork], float]) -> None:
        pass

    def spreads(self, widths: dict[tuple[str, str], float]) -> None:
        pass

    def gap_factors(self, factors: dict[str, float]) -> None:
        pass

    def biases(self, factors: dict[tuple[str, str], float]) -> None:
        pass

    def fell_back(self, reason: str) -> None:
        pass

    def replanned(self) -> None:
        pass

    def moved(self) -> None:
        pass
