"""DecodeWorker: the full engine in a decode-pool actor: it decodes, receiving a prompt's KV from
a prefill worker or prefilling it locally on the colocated path (worker_protocol/kv_receiver.py
for the steps of one request)."""

from __future__ import annotations

from kv_transfer.endpoint import KVEndpoint
from worker_protocol.host import EngineHost
from worker_protocol.kv_receiver import KVReceiverSide
from worker_protocol.messages import WorkerRole, WorkerSpec


class DecodeWorker(KVReceiverSide, KVEndpoint, EngineHost):
    role = WorkerRole.DECODE

    def __init__(
        self,
        worker_id: str,
        spec: WorkerSpec,
        incarnation: int = 0,
        router_code: str | None = None,
    ) -> None:
        EngineHost.__init__(self, worker_id, spec, incarnation, router_code=router_code)
        self.init_endpoint(self.kv_source(), self.kv_host, spec.kv_backend, spec.pair_timeout_s)

    async def abort(self, request_id: str) -> None:
        """Abort everywhere here, for good: the receive (before its blocks go), the engine, the
        stream (KVReceiverSide.abort_receive)."""
        await self.abort_receive(request_id)

    def shutdown(self) -> None:
        EngineHost.shutdown(self)
        self.close_endpoint()
