"""The balancer: the workers of a path the policy has already fixed (router/policy.py: the
colocated, disaggregated and threshold policies). The decode worker with the least load (active
tokens over capacity, plus KV usage), except that among workers within `affinity_margin` of the
least, the one holding the longest cached prefix wins; the prefill worker with the least
predicted queue time, among those whose pair with the decode worker is not failing; and, for a
handoff, the decode workers that another worker can prefill for.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.handoff_model import HandoffHealth
from router.pool_state import WorkerState
from router.predictions import MAX_FAILURE_RATE, RequestShape


def pick_decode(req: RequestShape, decode: Sequence[WorkerState], margin: float) -> WorkerState:
    least = min(w.load_score for w in decode)
    close = [w for w in decode if w.load_score <= least + margin]
    return max(close, key=lambda w: (w.prefix.match(req.hashes), -w.load_score))


def with_peer(prefill: Sequence[WorkerState], decode: Sequence[WorkerState]) -> list[WorkerState]:
    """The decode workers that another worker can prefill for: where a worker of both kinds is
    the only one that prefills, a handoff must decode elsewhere."""
    ids = {p.worker_id for p in prefill}
    return [w for w in decode if ids - {w.worker_id}]


def pick_prefill(
    prefill: Sequence[WorkerState], d: str = "", health: HandoffHealth | None = None
) -> WorkerState:
    """The prefill worker with the least predicted queue, among those whose pair with decode
    worker `d` is not failing (when any is not)."""

    def failing(w: WorkerState) -> bool:
        return health is not None and health.failure_rate(w.worker_id, d) > MAX_FAILURE_RATE

    return min(
        prefill,
        key=lambda w: (failing(w), w.model.chunked_s(w.queued_tokens, w.queued_pairs, 0, 0)[0]),
    )
