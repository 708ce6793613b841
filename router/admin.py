"""The operator's front door: pdserve.v1.Admin (Scale, ListWorkers) over grpc.aio, on its own port
(`pdserve serve --admin-port`, bound on the router's host). It drives the pools directly; the
request core sees the new membership at its next decision.

Scale answers INVALID_ARGUMENT naming the field for a size out of range, FAILED_PRECONDITION while
the pools are fixed (a server without Ray pools), UNAVAILABLE when new workers did not start.
ListWorkers carries the latest resize's outcome (`last_scale`), so a caller who stopped waiting
for Scale's answer still learns how it ended.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve_proto import admin_pb2 as pb
from pdserve_proto import admin_pb2_grpc as pb_grpc
from router.cluster import Cluster
from router.resize import FIELDS, ResizeReplaced, field_refusal
from router.workers import WorkerHandle
from worker_protocol.messages import WorkerRole

SERVICE = "pdserve.v1.Admin"
log = logging.getLogger("pdserve.admin")


def _worker(h: WorkerHandle) -> pb.Worker:
    info = h.info
    return pb.Worker(
        worker_id=h.worker_id,
        role=h.role.value,
        status=h.status.value,
        incarnation=h.incarnation,
        node_ip=info.node_ip if info else "",
        kv_host=info.kv_host if info else "",
        pid=info.pid if info else 0,
        active_requests=h.active,
        error=h.error,
    )


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, cluster: Cluster | None) -> None:
        self.cluster = cluster
        self._resizing: set[asyncio.Future[None]] = set()  # kept: the loop holds tasks weakly
        self.last_scale: pb.ScaleOutcome | None = None

    def _workers(self) -> list[pb.Worker]:
        if self.cluster is None:
            return []
        handles = sorted(
            self.cluster.pools.workers.values(), key=lambda h: (h.role.value, h.worker_id)
        )
        return [_worker(h) for h in handles]

    async def ListWorkers(  # noqa: N802 (the RPC's name)
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        restarts = self.cluster.pools.restarts if self.cluster is not None else {}
        return pb.ListWorkersResponse(
            workers=self._workers(),
            prefill_restarts=restarts.get(WorkerRole.PREFILL, 0),
            decode_restarts=restarts.get(WorkerRole.DECODE, 0),
            both_restarts=restarts.get(WorkerRole.BOTH, 0),
            last_scale=self.last_scale,
        )

    async def Scale(  # noqa: N802
        self, request: pb.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScaleResponse:
        if self.cluster is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this server's pools cannot be resized"
            )
        assert self.cluster is not None
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        both = request.workers if request.HasField("workers") else None
        drain = request.drain_timeout_s if request.HasField("drain_timeout_s") else None
        bad = grpc.StatusCode.INVALID_ARGUMENT
        sizes = {WorkerRole.PREFILL: prefill, WorkerRole.DECODE: decode, WorkerRole.BOTH: both}
        refused = field_refusal(sizes, drain)  # before the log and the outcome: not a resize
        if refused is not None:
            await context.abort(bad, refused)
        asked = ", ".join(f"{FIELDS[r]} {n}" for r, n in sizes.items() if n is not None)
        asked += "" if drain is None else f" (drain {drain:g} s)"
        log.info("scale asked: %s", asked)
        # A task of its own: the resize goes on, and its outcome is logged, when the caller
        # stops waiting (its deadline) and this handler is cancelled.
        resize = asyncio.ensure_future(self._resize(asked, prefill, decode, drain, both))
        self._resizing.add(resize)
        resize.add_done_callback(self._settled)
        try:
            await asyncio.shield(resize)
        except ValueError as exc:  # no worker would be left to decode, or too many workers
            await context.abort(bad, str(exc))
        except ResizeReplaced as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return pb.ScaleResponse(workers=self._workers())

    def _settled(self, resize: asyncio.Future[None]) -> None:
        self._resizing.discard(resize)
        if not resize.cancelled():
            resize.exception()  # read here too: _resize logged it, a caller gone never reads it

    async def _resize(
        self,
        asked: str,
        prefill: int | None,
        decode: int | None,
        drain: float | None,
        both: int | None,
    ) -> None:
        assert self.cluster is not None
        outcome = pb.ScaleOutcome(asked=asked, outcome="running", started_unix=time.time())
        self.last_scale = outcome

        def ended(how: str, detail: object = "") -> None:
            outcome.outcome, outcome.detail, outcome.ended_unix = how, str(detail), time.time()

        try:
            await self.cluster.scale(prefill, decode, drain, both)
        except ValueError as exc:
            log.warning("scale refused: %s", exc)
            ended("refused", exc)
            raise
        except ResizeReplaced as exc:
            log.warning("scale replaced: %s: %s", asked, exc)
            ended("replaced", exc)
            raise
        except RuntimeError as exc:
            log.warning("scale failed: %s: %s", asked, exc)
            ended("failed", exc)
            raise
        except asyncio.CancelledError:  # the server stops
            ended("failed", "cancelled: the server is stopping")
            raise
        except Exception as exc:
            log.exception("scale failed: %s", asked)
            ended("failed", f"{type(exc).__name__}: {exc}")
            raise
        log.info("scale done: %s", asked)
        ended("done")


def add_admin(server: grpc.aio.Server, cluster: Cluster | None) -> None:
    pb_grpc.add_AdminServicer_to_server(AdminServicer(cluster), server)
