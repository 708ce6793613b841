"""The sending side of a worker that prefills for a peer: its prompts' KV goes to the decode
worker that reserved blocks for it (prefill workers, and workers that do both).

One request, in order:
  1. `prefill(req, peer, dst_block_ids, skip_blocks)`: the request joins the engine's batch with
     max_tokens 1 and its blocks held past its end; prefills of many requests share steps under
     the token budget;
  2. in the step that computes the prompt's last chunk, the engine thread's per-layer hook starts
     the send and hands each layer to the connector as soon as it is in the cache, so the
     transfer of layer i overlaps the compute of layers i+1..;
  3. the first token is sampled; the worker waits for the send to end (DONE or FAILED, within
     its deadline) and only then frees the blocks (ownership stays here until the send ended);
  4. it returns the first token and the prefill and transfer times at once: the engine frees
     the blocks between steps, and on a busy worker the step running then (other prompts'
     prefill) may take seconds, which the first token does not wait for.
`abort_prefill(request_id)` ends a prefill early: no first token (or, when it came first, the
send FAILED), the blocks freed once the send has ended. A `prefill` that Ray runs after its
abort (ended.py) returns at once, without a first token.

A worker class combines this side with EngineHost (its engine, built with `on_layer` =
`self.on_layer`) and KVEndpoint (its connector); `init_sender` runs before EngineHost's
constructor, since the engine thread may call the hook as soon as it exists.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import NamedTuple

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.outputs import ScheduledRequest, SchedulerOutput
from kv_transfer import FailureReason, TransferRequest, TransferStatus
from kv_transfer.layout import KVLayout
from kv_transfer.torch_dist import TorchDistConnector
from worker_protocol.ended import EndedRequests
from worker_protocol.messages import PrefillResult, WorkerSpec, WorkRequest
from worker_protocol.transfer_wait import wait_transfer

log = logging.getLogger(__name__)


class _SendOutcome(NamedTuple):
    status: TransferStatus
    bytes: int
    seconds: float  # the connector's own: send started -> ended
    reason: str | None  # a FailureReason value when FAILED
    error: str | None


@dataclass(slots=True)
class _PendingSend:
    peer: str
    dst_block_ids: tuple[int, ...]
    skip_blocks: int  # leading blocks the decode side already holds
    started: bool = False
    error: str | None = None  # why the send could not go


class KVSenderSide:
    spec: WorkerSpec
    engine: LLMEngine
    aeng: AsyncEngine
    connector: TorchDistConnector
    layout: KVLayout
    ended: EndedRequests

    def init_sender(self) -> None:
        self._sends: dict[str, _PendingSend] = {}
        self._lock = threading.Lock()

    def sending(self, request_id: str) -> bool:
        """Whether `request_id` is being prefilled here for a peer."""
        with self._lock:
            return request_id in self._sends

    def wants_layers(self, so: SchedulerOutput) -> bool:
        """Engine thread: whether a step completes a prompt whose KV goes to a peer (only such a
        step needs the per-layer hook)."""
        sends = self._sends
        return any(s.sample and s.request_id in sends for s in so.scheduled)

    def on_layer(self, layer: int, so: SchedulerOutput) -> None:
        """Engine thread, after layer `layer` of a step is in the cache. Never raises: a send
        that can't go ends FAILED (the decode side recomputes); the engine keeps serving."""
        for s in so.scheduled:
            try:
                self._send_layer(layer, s)
            except Exception as exc:
                with self._lock:
                    send = self._sends.get(s.request_id)
                    if send is not None:
                        send.error = f"{type(exc).__name__}: {exc}"
                # Off the engine thread: ending a send waits for its lane (up to its I/O
                # timeout on a stuck link), and the step's other requests go on meanwhile. The
                # prompt's blocks go only once the send has ended (prefill's finally).
                try:
                    threading.Thread(
                        target=self._abort_quietly, args=(s.request_id,), daemon=True
                    ).start()
                except RuntimeError:  # no thread to be had: in line, then
                    self._abort_quietly(s.request_id)

    def _release_quietly(self, rid: str) -> None:
        try:
            self.connector.release(rid)  # a no-op once released
        except RuntimeError as exc:  # not expected: it was found ended just before
            log.warning("releasing the send of %s: %s", rid, exc)

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.connector.abort(rid)
        except Exception:
            pass  # never registered: nothing to end

    def _send_layer(self, layer: int, s: ScheduledRequest) -> None:
        if not s.sample:
            return  # the prompt isn't complete yet: its later chunks still write KV
        with self._lock:
            send = self._sends.get(s.request_id)
        if send is None or send.error is not None:
            return
        if not send.started:
            src = s.block_ids[send.skip_blocks : send.skip_blocks + len(send.dst_block_ids)]
            self.connector.start_send(
                TransferRequest(
                    transfer_id=s.request_id,
                    peer=send.peer,
                    src_block_ids=tuple(src),
                    dst_block_ids=send.dst_block_ids,
                    num_layers=self.layout.num_layers,
                    deadline_s=self.spec.kv_transfer_deadline_s,
                ),
                self.engine.runner.cache,
            )
            send.started = True
        self.connector.send_layer(s.request_id, layer)

    async def prefill(
        self,
        req: WorkRequest,
        peer: str,
        dst_block_ids: tuple[int, ...],
        skip_blocks: int,
    ) -> PrefillResult:
        rid = req.request_id
        if rid in self.ended:
            return PrefillResult(rid, None, None, False, 0.0, 0.0, 0, error="aborted")
        with self._lock:
            if rid in self._sends:
                raise ValueError(f"request_id {rid!r} is already being prefilled here")
            if dst_block_ids:
                self._sends[rid] = _PendingSend(peer, dst_block_ids, skip_blocks)
        first_params = replace(req.sampling, max_tokens=1, ignore_eos=True, stop=())
        t0 = time.monotonic()
        first = None
        first_lp = None
        queue_s = 0.0
        cached = 0
        try:
            q = await self.aeng.add(
                rid,
                lambda e: e.add_request(
                    list(req.prompt_token_ids),
                    first_params,
                    rid,
                    None,
                    True,
                    prefill_hold_s=req.prefill_hold_s,
                ),
            )
            async for out in self.aeng.stream(rid, q):
                if out.new_token_ids:
                    first = out.new_token_ids[0]
                    first_lp = out.logprobs[0] if out.logprobs else None
                    queue_s = out.queue_s
                    cached = out.num_cached_tokens
            t1 = time.monotonic()
            with self._lock:
                pending = self._sends.get(rid)
            if first is None:  # aborted: a started send would never get its last layers
                outcome = _SendOutcome(
                    TransferStatus.FAILED,
                    0,
                    0.0,
                    FailureReason.ABORTED.value,
                    "aborted before the first token",
                )
            else:
                outcome = await self._wait_send(rid, pending)
        finally:
            with self._lock:
                pending = self._sends.get(rid)
            if pending is not None and pending.started and self._live_send(rid):
                # Off the event loop (ending a send waits for its lane, up to its I/O timeout
                # on a stuck link), and to the end even if this call is cancelled meanwhile:
                # the blocks go only once the sender no longer reads them. The send stays
                # listed until then, so that an abort meanwhile waits for it too.
                await asyncio.shield(asyncio.to_thread(self._end_send_then_free, rid))
            else:
                with self._lock:
                    self._sends.pop(rid, None)
                if pending is not None and pending.started:  # ended, not yet forgotten (an
                    self._release_quietly(rid)  # abort before the first token ended it)
                self._free_blocks(rid)
        return PrefillResult(
            request_id=rid,
            first_token=first,
            first_logprobs=first_lp,
            transfer_ok=outcome.status is TransferStatus.DONE,
            prefill_s=t1 - t0,
            transfer_s=time.monotonic() - t1,
            bytes_sent=outcome.bytes,
            error=outcome.error,
            send_s=outcome.seconds,
            failure_reason=outcome.reason,
            queue_s=queue_s,
            num_cached_tokens=cached,
        )

    def _end_send_then_free(self, rid: str) -> None:
        try:
            self.connector.abort(rid)  # returns once the sender no longer reads the blocks
            self.connector.release(rid)
        finally:
            with self._lock:
                self._sends.pop(rid, None)
            self._free_blocks(rid)

    def _free_blocks(self, rid: str) -> None:
        """The send has ended (or never started): only now may the blocks go (step 4). Any
        thread."""
        self.aeng.call_threadsafe(lambda e: e.release_blocks(rid)).add_done_callback(
            _release_failed
        )

    def _live_send(self, rid: str) -> bool:
        try:
            return not self.connector.poll(rid).finished
        except KeyError:
            return False  # already released

    async def _wait_send(self, rid: str, pending: _PendingSend | None) -> _SendOutcome:
        if pending is None:  # nothing to send: the decode side holds the whole prompt
            return _SendOutcome(TransferStatus.DONE, 0, 0.0, None, None)
        if not pending.started:
            error = pending.error or "the prompt's last chunk never ran"
            return _SendOutcome(TransferStatus.FAILED, 0, 0.0, FailureReason.ERROR.value, error)
        status = await wait_transfer(self.connector, rid, self.spec.kv_transfer_deadline_s + 1.0)
        res = self.connector.result(rid)
        self.connector.release(rid)
        if res is None:
            return _SendOutcome(status, 0, 0.0, FailureReason.ERROR.value, "no result")
        reason = res.reason.value if res.reason is not None else None
        return _SendOutcome(status, res.bytes, res.seconds, reason, res.error)

    async def abort_prefill(self, request_id: str) -> None:
        """Stop a prefill (the client left): `prefill` then returns without a first token (or
        with one and its send FAILED, when the token came first) and its blocks are freed. A
        send under way is ended first: the engine's abort frees the blocks it holds, which the
        sender must no longer read. For good: a `prefill` for it that runs later does nothing
        (ended.py)."""
        self.ended.add(request_id)  # before any await: see ended.py

        def stop_send(e: LLMEngine) -> bool:
            # On the engine thread, between steps: no step can start the send after this.
            with self._lock:
                send = self._sends.get(request_id)
                if send is not None and send.error is None:
                    send.error = "aborted"
            return send is not None and send.started

        try:
            if await self.aeng.call(stop_send) and self._live_send(request_id):
                # Off the engine thread: ending a send waits for its lane (up to its I/O
                # timeout on a stuck link), and the engine's other requests keep stepping.
                await asyncio.to_thread(self.connector.abort, request_id)
        finally:
            await self.aeng.abort(request_id)


def _release_failed(fut: Future[bool]) -> None:
    exc = fut.exception()
    if exc is not None and not isinstance(exc, EngineDeadError):  # a stopped engine freed all
        log.warning("freeing a prefill's blocks failed: %s: %s", type(exc).__name__, exc)
