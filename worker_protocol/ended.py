"""The request ids a worker has aborted for good (the client left), so that a call for one of
them that runs after its abort does nothing.

Ray runs an async actor's calls out of order: an abort sent after a request's `reserve_kv`,
`generate` or `prefill` may start before it. Without this record the late call would reserve
blocks (and register a receive) or compute a prompt that nobody will ever end or read.

`reserve_kv`, `prefill` and `generate` check the record before their first await, and `abort`
writes it before its first await; all of them run on the actor's one event loop, which queues
their engine commands in that order. So such a call either queued its engine command before
the abort's (and the abort ends what it did) or sees the id ended. `finish_handoff` checks it
as it starts too; an abort during its wait for the KV ends the receive and the reservation,
and its engine command then finds nothing to join (an error, nothing left behind).

Every abort writes it, so the router never sends a call for an id to a worker after aborting
it there: a request resumed after a worker died goes by a new id (router/books.py), and so does
one the router goes on with on a worker after an abort there (a local prefill after a
reserve_kv that timed out, a re-plan onto another prefill worker: router/handoffs.py). The
latest REMEMBERED ids are kept.
"""

from __future__ import annotations

from collections import OrderedDict

REMEMBERED = 1 << 16  # the latest ids kept (about 10 MB at most)


class EndedRequests:
    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._remembered = remembered

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._remembered:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids
