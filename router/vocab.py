"""The request core's own vocabulary, free of any wire format: the front doors (router/convert.py
for gRPC) are the only places that map these to and from what travels."""

from __future__ import annotations

import enum


class RoutePath(enum.Enum):
    """The path a request asks for (AUTO: the router chooses) or takes."""

    AUTO = "auto"
    COLOCATED = "colocated"  # one decode worker prefills it in chunks next to its decodes
    DISAGGREGATED = "disaggregated"  # a prefill worker prefills it and streams the KV over


class FallbackReason(enum.Enum):
    """Why a disaggregated request's prompt was prefilled on its decode worker after all."""

    PAIRING_FAILED = "pairing_failed"  # the pair could not be made; retried after a backoff
    PAIR_NOT_READY = "pair_not_ready"  # the pair is being made (a worker just started)
    NO_RESERVATION = "no_reservation"  # the decode worker had no free blocks or sequence slot
    TRANSFER_FAILED = "transfer_failed"  # the KV send failed or passed its deadline
    PREFILL_FAILED = "prefill_failed"  # the prefill worker died, timed out or was stopped
    NO_PREFILL_WORKER = "no_prefill_worker"  # none was up when the request reached the pools


class Frontend(enum.Enum):
    """The front door a request came in by (a label on its metrics)."""

    GRPC = "grpc"
    HTTP = "http"
