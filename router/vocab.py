"""The request core's own vocabulary, free of any wire format: the front doors (router/convert.py
for gRPC) are the only places that map these to and from what travels."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

from engine.request import FinishReason  # stop | length | abort: the engine's own, as it ends

__all__ = ["FallbackReason", "FinishReason", "Frontend", "Placement", "RejectReason", "RoutePath"]


class RoutePath(enum.Enum):
    """The path a request asks for (AUTO: the router chooses) or takes."""

    AUTO = "auto"
    COLOCATED = "colocated"  # one decode worker prefills it in chunks next to its decodes
    DISAGGREGATED = "disaggregated"  # a prefill worker prefills it and streams the KV over


# The kinds of placement a decode worker's requests come by, as metrics label them, with whether
# the request prefilled there (the key of MeasuredGaps.itl_bias).
PLACEMENT_KINDS = (("colocated", True), ("received", False))


class FallbackReason(enum.Enum):
    """Why a disaggregated request's prompt was prefilled on its decode worker after all."""

    PAIRING_FAILED = "pairing_failed"  # the pair could not be made; retried after a backoff
    PAIR_NOT_READY = "pair_not_ready"  # the pair is being made (a worker just started)
    # the decode worker had no free blocks or sequence slot (or, a worker that does both, none
    # within the share reservations may hold)
    NO_RESERVATION = "no_reservation"
    TRANSFER_FAILED = "transfer_failed"  # the KV send failed or passed its deadline
    PREFILL_FAILED = "prefill_failed"  # the prefill worker died, timed out or was stopped
    NO_PREFILL_WORKER = "no_prefill_worker"  # none was up when the request reached the pools


class RejectReason(enum.Enum):
    """Why a request was refused before any work was done (a label on its metric, and what the
    front door tells the client beside a retry hint)."""

    QUEUE_FULL = "queue_full"  # too many requests wait for a first token, or run
    SLO = "slo"  # its predicted TTFT misses its SLO, and waiting would help
    DECODE_RATE = "decode_rate"  # requests come faster than the decodes hold the ITL SLO
    CLIENT_LIMIT = "client_limit"  # its client already runs as many requests as it may
    NO_WORKERS = "no_workers"  # no decode worker is up


class Frontend(enum.Enum):
    """The front door a request came in by (a label on its metrics)."""

    GRPC = "grpc"
    HTTP = "http"


_placements = itertools.count()


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where the pools run one request: a path that is taken (never AUTO; the strings
    "colocated" and "disaggregated" are taken for theirs), and the workers (None: whichever the
    pools pick). The workers know the request by `request_id`."""

    path: RoutePath
    request_id: str = field(default_factory=lambda: f"placed-{next(_placements)}")
    prefill_worker: str | None = None  # the disaggregated path's only
    decode_worker: str | None = None
    # The disaggregated path's only: how soon its KV may land on the decode worker, which until
    # then runs its own prompts as if the handoff were not coming (engine kv_handoff.reserve).
    kv_due_in_s: float = 0.0
    # The most its prompt may wait for the decodes running where it is prefilled (the engine's
    # Request.prefill_hold_s; None: that worker's own hold; 0: never).
    prefill_hold_s: float | None = None

    def __post_init__(self) -> None:
        taken = (RoutePath.COLOCATED, RoutePath.DISAGGREGATED)
        path = next((p for p in taken if self.path in (p, p.value)), None)
        if path is None:
            shown = self.path.value if isinstance(self.path, RoutePath) else repr(self.path)
            raise ValueError(
                "a placement's path is RoutePath.COLOCATED or RoutePath.DISAGGREGATED (or "
                f"'colocated' or 'disaggregated'), not {shown}"
            )
        object.__setattr__(self, "path", path)  # a string given becomes its RoutePath
        if (
            self.path is RoutePath.DISAGGREGATED
            and self.prefill_worker is not None
            and self.prefill_worker == self.decode_worker
        ):
            raise ValueError(
                f"{self.prefill_worker} cannot hand a prompt's KV to itself: one worker "
                "prefilling and decoding a request is the colocated path"
            )
        if not 0.0 <= self.kv_due_in_s < math.inf:
            raise ValueError(f"kv_due_in_s must be finite and >= 0, got {self.kv_due_in_s}")
        if self.prefill_hold_s is not None and not 0.0 <= self.prefill_hold_s < math.inf:
            raise ValueError(
                f"prefill_hold_s must be finite and >= 0 (or None), got {self.prefill_hold_s}"
            )
        if self.kv_due_in_s and self.path is not RoutePath.DISAGGREGATED:
            raise ValueError(
                "kv_due_in_s is for a handoff: the colocated path has no KV to wait for"
            )


class FailureReason(enum.Enum):
    """Why a request ended without its answer: each front door maps it to its own status."""

    INVALID = "invalid"  # a field out of range (a client's mistake)
    OVERLOADED = "overloaded"  # admission refused it; RejectReason says why
    NO_WORKERS = "no_workers"  # no decode worker is up
    WORKER_FAILED = "worker_failed"  # a worker died or timed out under it; no resume was left
    HANDOFF_FAILED = "handoff_failed"  # its KV never came, under --kv-failure-policy fail
    SHUTTING_DOWN = "shutting_down"  # the server is stopping, and its drain timeout passed
    INTERNAL = "internal"  # a fault in the router itself
