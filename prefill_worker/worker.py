"""PrefillWorker: the engine in prefill role inside a prefill-pool actor: it prefills prompts and
streams their KV to the decode worker that reserved blocks for them (worker_protocol/kv_sender.py
for the steps of one request). Its steps stream KV layer by layer, so it captures no decode
graphs."""

from __future__ import annotations

from kv_transfer.endpoint import KVEndpoint
from worker_protocol.host import EngineHost
from worker_protocol.kv_sender import KVSenderSide
from worker_protocol.messages import WorkerRole, WorkerSpec


class PrefillWorker(KVSenderSide, KVEndpoint, EngineHost):
    role = WorkerRole.PREFILL

    def __init__(
        self,
        worker_id: str,
        spec: WorkerSpec,
        incarnation: int = 0,
        router_code: str | None = None,
    ) -> None:
        self.init_sender()
        EngineHost.__init__(
            self, worker_id, spec, incarnation, on_layer=self.on_layer, router_code=router_code
        )
        self.init_endpoint(
            self.kv_source(), self.kv_host, spec.kv_backend, spec.pair_timeout_s, spec.kv_faults
        )

    async def abort(self, request_id: str) -> None:
        """Stop a prefill (the client left): `prefill` then returns without a first token, its
        send ends FAILED and its blocks are freed; for good (KVSenderSide.abort_prefill)."""
        await self.abort_prefill(request_id)

    def shutdown(self) -> None:
        EngineHost.shutdown(self)
        self.close_endpoint()
