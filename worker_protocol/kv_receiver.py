"""The receiving side of a worker that decodes (decode workers, and workers that do both).

Colocated request: `generate` (EngineHost's) streams tokens; the engine prefills it locally in
chunks under the same token budget as the running decodes.
Disaggregated request, in order:
  1. `reserve_kv`: blocks for the prompt are allocated here first and the connector starts
     receiving into those past the prefix-cache hit (only they travel); the answer (KVTarget)
     names them for the prefill worker;
  2. (the prefill worker prefills and streams the KV layer by layer; the router relays its first
     token)
  3. `finish_handoff`: waits for the receive to end within its deadline; DONE -> the request joins
     the running batch with its first token; FAILED -> the prompt is recomputed here. Either way
     tokens then stream as for a colocated request.
The engine runs on its own thread (AsyncEngine); the connector's threads write only into blocks
reserved for a transfer, which the engine does not read until step 3.
A call for a request already aborted for good here (Ray ran the abort first: ended.py) does
nothing: `reserve_kv` reserves nothing, `generate` and `finish_handoff` end at once (abort).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.token_logprobs import TokenLogprobs
from kv_transfer import TransferRequest, TransferStatus
from kv_transfer.layout import KVLayout
from kv_transfer.torch_dist import TorchDistConnector
from worker_protocol.ended import EndedRequests
from worker_protocol.messages import KVTarget, TokenChunk, WorkerSpec, WorkRequest
from worker_protocol.transfer_wait import wait_transfer


class KVReceiverSide:
    worker_id: str
    spec: WorkerSpec
    engine: LLMEngine
    aeng: AsyncEngine
    connector: TorchDistConnector
    layout: KVLayout
    ended: EndedRequests
    # The most of the engine's slots and blocks that reservations may hold (kv_handoff.reserve):
    # all of them on a worker that only decodes.
    reserve_share: float = 1.0

    async def reserve_kv(
        self, req: WorkRequest, peer_id: str, due_in_s: float = 0.0
    ) -> KVTarget | None:
        """Reserve blocks for `req`'s prompt and start receiving its KV from `peer_id` into those
        past the prefix-cache hit; the KV is expected no sooner than `due_in_s` from now
        (kv_handoff.reserve). None: no free blocks or sequence slot now, or reservations
        would hold more than `reserve_share` of them (nothing reserved).
        Both happen in one engine call, so an abort that starts after this call (it waits for
        the engine first) finds the receive registered; one that starts before it makes this call
        reserve nothing (ended.py)."""
        rid = req.request_id
        if rid in self.ended:
            return None
        bs = self.engine.config.cache.block_size

        def reserve(e: LLMEngine) -> KVTarget | None:
            res = e.reserve_for_kv(
                list(req.prompt_token_ids),
                req.sampling,
                rid,
                share=self.reserve_share,
                due_in_s=due_in_s,
                prefill_hold_s=req.prefill_hold_s,
            )
            if res is None:
                return None
            skip = res.num_cached_tokens // bs
            dst = tuple(res.block_ids[skip:])
            try:
                self.connector.start_recv(
                    TransferRequest(
                        transfer_id=rid,
                        peer=peer_id,
                        src_block_ids=dst,  # the receiver reads none of these
                        dst_block_ids=dst,
                        num_layers=self.layout.num_layers,
                        # Registered before the prefill starts: it covers its queue and compute.
                        deadline_s=self.spec.prefill_timeout_s + self.spec.kv_transfer_deadline_s,
                    ),
                    e.runner.cache,
                )
            except BaseException:
                e.abort(rid)  # frees the reservation
                raise
            return KVTarget(rid, dst, skip, res.num_cached_tokens)

        return await self.aeng.call(reserve)

    async def finish_handoff(
        self,
        request_id: str,
        first_token: int | None,
        first_logprobs: TokenLogprobs | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Join the batch once the KV is in (or recompute if it never came); stream tokens."""
        if request_id in self.ended:  # its abort ended the receive and freed the blocks
            yield TokenChunk.aborted(request_id, self.worker_id)
            return
        if first_token is None:  # the prefill side failed: nothing more will arrive
            await asyncio.to_thread(self._end_receive, request_id)
        ok = first_token is not None and await self._wait_kv(request_id)
        if request_id in self.ended:  # aborted during the wait: the abort freed everything
            yield TokenChunk.aborted(request_id, self.worker_id)
            return
        q = self.aeng.open_stream(request_id)
        try:
            if ok:
                assert first_token is not None
                first = await self.aeng.call(
                    lambda e: e.kv_arrived(request_id, first_token, first_logprobs)
                )
                yield TokenChunk.from_output(first, self.worker_id)
                if first.finished:
                    return
            else:
                await self.aeng.call(lambda e: e.kv_failed(request_id))
            recomputed = first_token is not None and not ok  # the KV was sent, never landed
            async for out in self.aeng.stream(request_id, q):
                chunk = TokenChunk.from_output(out, self.worker_id)
                if recomputed:
                    chunk, recomputed = replace(chunk, kv_recomputed=True), False
                yield chunk
        finally:
            self.aeng.close_stream(request_id)

    async def _wait_kv(self, request_id: str) -> bool:
        # The prefill worker has answered by now: its send has ended, so this wait is short.
        timeout = self.spec.kv_transfer_deadline_s + 1.0
        status = await wait_transfer(
            self.connector, request_id, timeout, lambda: request_id in self.ended
        )
        if request_id in self.ended:  # its abort ends the receive and releases it
            return False
        self.connector.release(request_id)
        return status is TransferStatus.DONE

    async def abort_receive(self, request_id: str) -> None:
        """Abort everywhere here, for good: the receive (before its blocks go), the engine, the
        stream; a call for it that runs later does nothing (ended.py)."""
        self.ended.add(request_id)  # before any await: see ended.py
        # To the end even if this call is cancelled: the receive, then the engine's blocks.
        await asyncio.shield(self._abort_for_good(request_id))

    async def _abort_for_good(self, request_id: str) -> None:
        # A reserve_kv that started before this abort may still be queued on the engine thread:
        # let it run first, so that its receive exists to be ended below. The receive ends
        # whatever that call does: a wait for it (_wait_kv) has stopped at the mark above.
        try:
            await self.aeng.call(lambda e: None)
        finally:
            await asyncio.to_thread(self._end_receive, request_id)
        await self.aeng.abort(request_id)

    def _end_receive(self, request_id: str) -> None:
        """End a receive and forget it (a no-op when none was registered). Off the event loop:
        ending a direct receive waits for its data (up to its I/O timeout on a stuck link),
        and this worker's other streams, loads and aborts keep going meanwhile."""
        self.connector.abort(request_id)
        self.connector.release(request_id)
