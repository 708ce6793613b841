"""The engine's side of a disaggregated handoff: KV computed elsewhere joins this engine's batch.

Decode side, in order:
  1. `reserve`: blocks for the whole prompt are allocated before any byte moves (so a transfer
     never lands in a full pool). Leading blocks already in the prefix cache are reused and
     reported as `num_cached_tokens`: only the blocks after them need to travel. The request
     waits in WAITING_FOR_KV, holding its blocks and a sequence slot.
  2. `complete`: the KV has arrived with the first token sampled by the prefill side; the
     request joins the running batch as if it had prefilled here.
  3. or `fail`: the transfer failed; blocks are freed and the request goes back to the front of
     the waiting queue, to recompute its prompt locally.
Prefill side: a request added with `hold_blocks_on_finish` keeps its blocks after it finishes,
until `Scheduler.release_held` once its send has ended (DONE or FAILED).

Invariant for callers: the engine frees reserved or held blocks whenever it is told to (abort,
fail, release) and knows nothing of transfers. Whoever owns the connector must end the transfer
first (abort returns only when the connector no longer touches those blocks), then tell the
engine. The workers' abort paths do it in that order.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from engine.kv_cache_manager import cdiv
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler


class KVReservation(NamedTuple):
    request_id: str
    block_ids: tuple[int, ...]  # the prompt's whole block table on this engine
    num_cached_tokens: int  # blocks [0, num_cached_tokens / block_size) need no transfer


def within_share(share: float, max_num_seqs: int, num_blocks: int, seqs: int, blocks: int) -> bool:
    """Whether reservations for peers' KV holding `seqs` sequence slots and `blocks` blocks
    together stay within `share` of an engine's slots and blocks (`reserve`'s rule; the router
    asks it of a prompt alone, to know whether a worker could ever take its handoff)."""
    return seqs <= share * max_num_seqs and blocks <= share * num_blocks


def reserve(
    sched: Scheduler, req: Request, share: float = 1.0, due_in_s: float = 0.0
) -> KVReservation | None:
    """Allocate blocks for `req`'s prompt; None (nothing changed) when slots or blocks lack.

    `due_in_s`: how soon its KV may land. Until then the scheduler sizes chunks and holds
    prompts as if it were not coming (Scheduler.kv_due): whole-budget chunks, no wait for its
    decode; its blocks and slot stay reserved. 0: it may land at once.

    `share`: the most of the engine's sequence slots and blocks that requests waiting for KV
    may hold together, this one included. An engine that also prefills for peers keeps the
    rest for its own prefills: two such engines, each full of reservations for KV that the
    other has yet to prefill, would otherwise wait on each other until the prefills time out.
    """
    if req.request_id in sched.requests:
        raise ValueError(f"request_id {req.request_id!r} is already in use")
    if sched.num_seq_slots_used >= sched.config.max_num_seqs:
        return None
    kv = sched.kv
    if share < 1.0:
        held = sum(len(r.block_ids) for r in sched.waiting_for_kv.values())
        seqs, blocks = len(sched.waiting_for_kv) + 1, held + cdiv(req.num_tokens, kv.block_size)
        if not within_share(share, sched.config.max_num_seqs, kv.pool.num_blocks, seqs, blocks):
            return None
    computed = kv.get_computed_blocks(req)
    if not kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed):
        return None
    req.status = RequestStatus.WAITING_FOR_KV
    req.kv_due_at = time.monotonic() + max(0.0, due_in_s)
    sched.requests[req.request_id] = req
    sched.waiting_for_kv[req.request_id] = req
    return KVReservation(req.request_id, tuple(req.block_ids), computed.num_tokens)


def complete(sched: Scheduler, request_id: str, first_token: int) -> Request:
    """The prompt's KV is in the reserved blocks: start decoding from `first_token`."""
    req = sched.waiting_for_kv.pop(request_id)
    req.num_computed_tokens = req.num_prompt_tokens
    sched.kv.cache_computed_blocks(req)
    req.append_output(first_token)
    req.status = RequestStatus.RUNNING
    sched.running.append(req)
    reason = req.check_stop_token()
    if reason is not None:
        sched.running.remove(req)
        sched.finish(req, reason)
    return req


def fail(sched: Scheduler, request_id: str) -> Request:
    """The transfer failed: free the reserved blocks and recompute the prompt locally."""
    req = sched.waiting_for_kv.pop(request_id)
    sched.kv.free(req)
    req.kv_due_at = 0.0
    req.num_computed_tokens = 0
    req.status = RequestStatus.WAITING
    sched.waiting.appendleft(req)
    return req
