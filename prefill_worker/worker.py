"""PrefillWorker: the engine in prefill role inside a prefill-pool actor: it prefills prompts and
streams their KV to the decode worker that reserved blocks for them (worker_protocol/kv_sender.py
for the steps of one request), and answers requests of one token itself (`generate`). Its steps
stream KV layer by layer, so it captures no decode graphs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kv_transfer.endpoint import KVEndpoint
from worker_protocol.host import EngineHost
from worker_protocol.kv_sender import KVSenderSide
from worker_protocol.messages import TokenChunk, WorkerRole, WorkerSpec, WorkRequest


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

    async def generate(self, req: WorkRequest) -> AsyncIterator[TokenChunk]:
        """A request whose whole answer is its first token (max_tokens 1: a score, a label, an
        echoed prompt's logprobs), prefilled and answered here: it has nothing to decode, so
        no decode worker takes part and no KV moves (router/candidates.py places such requests
        on prefill workers too). A longer one is refused: this worker does not decode."""
        if req.sampling.max_tokens > 1:
            raise ValueError(
                f"{self.worker_id} is a prefill worker: it answers requests of one token only "
                f"(max_tokens 1), not {req.sampling.max_tokens}"
            )
        async for chunk in EngineHost.generate(self, req):
            yield chunk

    async def abort(self, request_id: str) -> None:
        """Stop a prefill (the client left): `prefill` then returns without a first token, its
        send ends FAILED and its blocks are freed; for good (KVSenderSide.abort_prefill). A
        request answered here (`generate`) ends as aborted, its blocks freed, the same way."""
        await self.abort_prefill(request_id)

    def shutdown(self) -> None:
        EngineHost.shutdown(self)
        self.close_endpoint()
