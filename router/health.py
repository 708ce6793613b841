"""grpc.health.v1 for the gRPC port, whose Watch streams end at shutdown.

A Watch stream (a load balancer's) never ends by itself, and the server's drain waits for every
call to end: at shutdown the server sets NOT_SERVING, then `end_watches` ends each stream once
it has said so. Each stream writes only from its own handler, between waits on the statuses'
condition: a stream is never cancelled mid-write (gRPC refuses a second write while one is in
flight, and the call then never ends, holding the drain to its timeout).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Status = int  # health_pb2.HealthCheckResponse.ServingStatus, an enum's value
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class DrainingHealth(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._status: dict[str, Status] = {}
        # One condition for every service: statuses change a few times in a server's life,
        # and the open service keeps nothing per name a caller asks for.
        self._changed = asyncio.Condition()
        self._ending = False

    async def set(self, service: str, status: Status) -> None:
        self._status[service] = status
        await self._notify()

    async def end_watches(self) -> None:
        """End every Watch stream, each once it has said NOT_SERVING."""
        self._ending = True
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: Any) -> None:  # noqa: N802 (gRPC's name)
        """Each change of the service's status, written outside the lock: a watcher that
        reads nothing holds up its own stream, not `set()` or `end_watches()` (the drain)."""
        said = None
        while True:
            status = self._watched(request.service)
            if status != said:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                said = status
            if self._ending and said == NOT_SERVING:  # ending came while it wrote: say so
                return
            async with self._changed:
                while self._watched(request.service) == said and not self._ending:
                    await self._changed.wait()

    def _watched(self, service: str) -> Any:
        return NOT_SERVING if self._ending else self._status.get(service, UNKNOWN)
