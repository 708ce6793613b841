"""The scheduler's requests and the queues they move through (engine/scheduler.py builds
Scheduler on this and decides what each step runs).

  waiting          new requests, and preempted ones at the front, holding no blocks;
  running          admitted, in admission order: the newest is preempted first;
  waiting_for_kv   a handoff's decode side: blocks reserved, its KV on its way
                   (engine/kv_handoff.py), not yet running;
  held             finished, their blocks kept until their KV has been sent (release_held).

Here are the moves that decide nothing about a step: a request added, finished (an abort or stop
string, its stop token or length, a pool that cannot hold it), preempted (recompute: its blocks
freed, its computed tokens forgotten), and a step's results applied. A request is in `requests`
from its addition until it finishes, and in at most one of waiting, running and waiting_for_kv.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator

from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import FinishReason, Request, RequestStatus

_FINISH_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}


class RequestQueues:
    """The live requests, by queue, and the finished ones whose blocks are held."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Disaggregated decode side: blocks reserved, KV on its way (see kv_handoff.py).
        self.waiting_for_kv: dict[str, Request] = {}
        # Prefill side: finished requests whose blocks stay until their KV has been sent.
        self.held: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        # Requests ended by the scheduler itself (the pool can't hold them), for the engine to
        # report; drained by `take_capacity_finished`.
        self.capacity_finished: list[Request] = []

    # -- admission and removal -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[Request]:
        """End requests (abort, stop string): free their blocks; unknown ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:
                self.waiting_for_kv.pop(rid, None)
            self.finish(req, reason, hold=reason is not FinishReason.ABORT)
            done.append(req)
        return done

    def finish(self, req: Request, reason: FinishReason, hold: bool = True) -> None:
        """Mark an already dequeued request finished; free (or hold) its blocks."""
        req.status = _FINISH_STATUS[reason]
        req.finish_reason = reason
        if hold and req.hold_blocks_on_finish:
            self.held[req.request_id] = req  # freed by release_held() once the KV is sent
        else:
            self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a finished request held for a KV send; False if none held."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def running_prefills(self) -> Iterator[Request]:
        """The running requests still prefilling (more than their next token to compute)."""
        return (r for r in self.running if r.num_tokens - r.num_computed_tokens > 1)

    def kv_due(self) -> Iterator[Request]:
        """The handoffs waiting for KV that may land now (Request.kv_due_at passed). One due
        later is still queued or prefilling on its prefill worker: steps here need not make
        room for it yet, and a prompt here does not wait for its decode."""
        now = time.monotonic()
        return (r for r in self.waiting_for_kv.values() if r.kv_due_at <= now)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_seq_slots_used(self) -> int:
        return len(self.running) + len(self.waiting_for_kv)

    # -- preemption and capacity -------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _end_for_capacity(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.stop_reason = "kv_cache_capacity"
        self.finish(req, FinishReason.LENGTH)
        self.capacity_finished.append(req)

    def take_capacity_finished(self) -> list[Request]:
        done, self.capacity_finished = self.capacity_finished, []
        return done

    # -- results ------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish on EOS/stop ids/length.

        Returns the requests that received a token this step (finished ones included).
        """
        for s in out.scheduled:
            live = self.requests.get(s.request_id)
            if live is None:
                continue  # ended (aborted) after it was scheduled
            live.num_computed_tokens += len(s.token_ids)
            self.kv.cache_computed_blocks(live)
        touched: list[Request] = []
        for rid, tok in zip(result.request_ids, result.token_ids):
            req = self.requests.get(rid)
            if req is None:
                continue
            req.append_output(tok)
            touched.append(req)
            reason = req.check_stop_token()
            if reason is not None:
                self.running.remove(req)
                self.finish(req, reason)
        return touched
