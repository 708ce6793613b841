"""Errors the pools raise to the request core, and how any error reads as a FailureReason."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from router.vocab import FailureReason


class WorkerLost(RuntimeError):
    """The decode worker streaming a request died, stopped, is leaving its pool, or cannot be
    reached for now. The request may resume elsewhere from its prompt and the tokens already
    streamed."""

    def __init__(self, worker_id: str, cause: str) -> None:
        super().__init__(f"worker {worker_id} lost: {cause}")
        self.worker_id = worker_id


class HandoffFailed(RuntimeError):
    """A disaggregated request's KV did not come from its prefill worker, and the server was told
    to fail such requests (`--kv-failure-policy fail`) rather than prefill them on the decode
    worker. Its blocks have been freed on both workers."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"KV handoff failed ({reason}): {detail}")
        self.reason = reason


class ShuttingDown(RuntimeError):
    """The server is stopping and ended the request before it finished (router/endings.py):
    its drain timeout passed, or it was interrupted again. It was aborted on its workers."""


def failure_reason(exc: BaseException) -> FailureReason:
    """What the core (or a front door's own check) raised, as one reason both doors answer."""
    from router.core_types import NoWorkers, Overloaded  # core_types does not import this module

    if isinstance(exc, InvalidRequestError):
        return FailureReason.INVALID
    if isinstance(exc, Overloaded):
        return FailureReason.OVERLOADED
    if isinstance(exc, NoWorkers):
        return FailureReason.NO_WORKERS
    if isinstance(exc, ShuttingDown):
        return FailureReason.SHUTTING_DOWN
    if isinstance(exc, HandoffFailed):
        return FailureReason.HANDOFF_FAILED
    if isinstance(exc, (WorkerLost, TimeoutError)) or any(
        c.__module__.startswith("ray.") for c in type(exc).__mro__
    ):
        return FailureReason.WORKER_FAILED  # a worker, or the Ray runtime under it
    return FailureReason.INTERNAL
