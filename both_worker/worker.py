"""BothWorker: a worker that, request by request, prefills for a peer (streaming the KV out,
worker_protocol/kv_sender.py) or decodes (receiving the KV from a peer, or prefilling locally,
worker_protocol/kv_receiver.py). Its one engine serves both: a prefill for a peer shares steps
with its own decodes under the token budget, and its KV pair with another worker carries
transfers either way."""

from __future__ import annotations

from kv_transfer.endpoint import KVEndpoint
from worker_protocol.host import EngineHost
from worker_protocol.kv_receiver import KVReceiverSide
from worker_protocol.kv_sender import KVSenderSide
from worker_protocol.messages import WorkerRole, WorkerSpec


class BothWorker(KVSenderSide, KVReceiverSide, KVEndpoint, EngineHost):
    role = WorkerRole.BOTH
    # Reservations for KV from peers may hold at most half the slots and blocks: the rest stays
    # for prefills, its peers' among them. Two workers each full of reservations for KV the
    # other has yet to prefill would otherwise stall until the prefills time out; past the
    # share, the router's handoff falls back to a prefill on this worker (no_reservation).
    reserve_share = 0.5

    def __init__(
        self,
        worker_id: str,
        spec: WorkerSpec,
        incarnation: int = 0,
        router_code: str | None = None,
    ) -> None:
        self.init_sender()
        EngineHost.__init__(
            self,
            worker_id,
            spec,
            incarnation,
            on_layer=self.on_layer,
            wants_layers=self.wants_layers,
            router_code=router_code,
        )
        self.init_endpoint(
            self.kv_source(), self.kv_host, spec.kv_backend, spec.pair_timeout_s, spec.kv_faults
        )

    async def abort(self, request_id: str) -> None:
        """Abort `request_id` here, as the side it is on: a prefill for a peer (its send ends
        FAILED and `prefill` frees the blocks) or a request decoding here (its receive, engine
        request and stream). For good, whichever side a late call would be on (ended.py)."""
        if self.sending(request_id):
            await self.abort_prefill(request_id)
        else:
            await self.abort_receive(request_id)

    def shutdown(self) -> None:
        EngineHost.shutdown(self)
        self.close_endpoint()
