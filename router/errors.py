"""Errors the pools raise to the request core."""

from __future__ import annotations


class WorkerLost(RuntimeError):
    """The decode worker streaming a request died; it has left its pool. The request may resume
    elsewhere from its prompt and the tokens already streamed."""

    def __init__(self, worker_id: str, cause: str) -> None:
        super().__init__(f"worker {worker_id} died: {cause}")
        self.worker_id = worker_id


class HandoffFailed(RuntimeError):
    """A disaggregated request's KV did not come from its prefill worker, and the server was told
    to fail such requests (`--kv-failure-policy fail`) rather than prefill them on the decode
    worker. Its blocks have been freed on both workers."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"KV handoff failed ({reason}): {detail}")
        self.reason = reason


def worker_failure(exc: BaseException) -> bool:
    """A worker (or the Ray runtime under it) failed, as opposed to a fault in the router: what
    a front door reports as unavailable rather than internal."""
    return any(c.__module__.startswith("ray.") for c in type(exc).__mro__) or isinstance(
        exc, TimeoutError
    )
