"""The step scheduler: pure Python, no tensors, testable with fake runner outputs.

Each step has one token budget (`max_num_batched_tokens`) and at most `max_num_seqs` running
requests. Every request's computed tokens catch up to its total tokens; there is no separate
prefill or decode code path. Within a step:
  1. running requests with one token left (decodes) are scheduled first, so a long prompt never
     stalls them;
  2. running requests still prefilling continue with the budget left, in admission order;
  3. waiting requests (new or preempted) are admitted with what is left, chunked to fit.
With `step_target_s` set, a step that has decodes in it (or runs while a handoff's KV may land:
see Request.kv_due_at) takes only as many prefill tokens as keep it near that time (a ChunkSizer
learns how many from the steps just run); any other step takes the whole budget, at full prefill
efficiency, except that a step of prompts alone (no decodes) that completes a prompt takes no
more tokens of the prompts behind it than their share of a step's fixed cost buys
(engine/prompt_steps.py: on a CPU a few, so a prompt's first token does not wait for a full
budget of the next prompts' chunks; on a GPU the budget fills).
Where even the smallest chunk takes such a step past the target, with a hold set (a request's
own, else `prefill_hold_s`) the prompts wait instead while the running decodes will end within
their hold (engine/prompt_hold.py).
When blocks run out, the newest running request is preempted: its blocks are freed and it is
recomputed later from prompt + outputs (recompute preemption). A request alone and out of
blocks waits for those held for a while (reservations for KV on its way, a finished prompt's
blocks kept for its send), up to BLOCKS_WAIT_S; one the whole pool cannot hold ends (length,
kv_cache_capacity).

Invariants checked at the end of every `schedule()`: budget respected (a lone unchunkable prefill
excepted), no request scheduled twice, running count <= max_num_seqs, every scheduled request
holds enough blocks for its tokens.

The queues themselves, and the moves between them that decide nothing about a step (a request
added, finished or preempted, a step's results applied), are engine/request_queues.py's.
"""

from __future__ import annotations

import time

from engine.chunk_sizer import ChunkSizer
from engine.config import SchedulerConfig
from engine.kv_cache_manager import ComputedBlocks, KVCacheManager, cdiv
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.prompt_hold import PromptHold
from engine.prompt_steps import PromptStepCost
from engine.request import Request, RequestStatus
from engine.request_queues import RequestQueues
from engine.seen import seen

# The most a request alone and out of blocks waits for those others hold for a while.
BLOCKS_WAIT_S = 30.0


class Scheduler(RequestQueues):
    """Each step's work, chosen from the queues it builds on (engine/request_queues.py)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        super().__init__(kv)
        self.config = config
        self.sizer = (
            ChunkSizer(config.step_target_s, config.max_num_batched_tokens)
            if config.step_target_s is not None and config.enable_chunked_prefill
            else None
        )
        self.prompt_steps = PromptStepCost()
        self.prompt_hold = PromptHold(config.prefill_hold_s)  # prompts waiting for the decodes

    @property
    def hold_left_s(self) -> float | None:
        """What is left of the hold to the prompt in line (waiting, or prefilling in chunks) with
        the least of it (PromptHold.left)."""
        return self.prompt_hold.left((*self.running_prefills(), *self.waiting))

    @property
    def num_held_steps(self) -> int:
        return self.prompt_hold.steps

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, int] = {}  # request_id -> tokens scheduled, in schedule order
        preempted: list[str] = []

        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (decodes if len(r.token_ids) - r.num_computed_tokens == 1 else prefills).append(r)
        if self.sizer is not None and (decodes or any(self.kv_due())):
            # Handoffs whose KV may land count too: one that lands during a whole-budget
            # prefill step would wait that step out before its second token.
            budget = min(budget, len(decodes) + self.sizer.chunk)
        if self.prompt_hold.holds(decodes, [*prefills, *self.waiting], self.sizer, self.kv_due()):
            budget = len(decodes)  # the decodes alone: no chunk, no admission
        # Prompts alone: once one completes in this step, the later ones take at most this.
        behind = len(prefills) + len(self.waiting) - 1
        fill_cap = None if decodes else self.prompt_steps.fill_cap(behind)
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 1:
                # A prefill chunk shrinks to the free blocks rather than evict a running request.
                n = max(1, min(n, self.kv.free_slots(req)))
            while not self.kv.allocate_slots(req, n):
                if len(self.running) == 1 and not chunks:
                    # Alone and still out of blocks: it waits for those others hold for a while
                    # (unscheduled, keeping its own), else the pool can never hold it.
                    if not self._waits_for_blocks(req):
                        self._end_for_capacity(req)
                    break
                victim = self.running[-1]
                if victim.request_id in chunks:
                    budget += chunks.pop(victim.request_id)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                chunks[req.request_id] = n
                budget -= n
                req.blocks_wait_since = None
                if fill_cap is not None and n == req.num_tokens - req.num_computed_tokens:
                    budget = min(budget, fill_cap)  # it completes here (decodes: none)

        if not preempted:
            budget = self._admit_waiting(budget, chunks, fill_cap)

        out = self._build_output(chunks, preempted)
        self._check_invariants(out)
        return out

    def set_step_target(self, target_s: float | None) -> None:
        """Change the step target while serving (the router tunes it from the inter-token gaps
        its requests see here): the chunk sizer is made, retargeted (keeping the chunk it
        learned) or dropped (None: a chunk is the whole budget again)."""
        if target_s is not None and not target_s > 0:
            raise ValueError(f"step_target_s must be > 0, got {target_s}")
        if target_s is not None and not self.config.enable_chunked_prefill:
            raise ValueError("step_target_s sizes prefill chunks: it needs chunked prefill")
        if target_s is None:
            self.sizer = None
        elif self.sizer is None:
            self.sizer = ChunkSizer(target_s, self.config.max_num_batched_tokens)
        else:
            self.sizer.target_s = target_s

    def observe_step(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """What the step just run cost: teaches the chunk sizer (a no-op without a target) and
        what a step of prompts alone costs."""
        self.prompt_steps.observe(prefill_tokens, decodes, seconds)
        if self.sizer is not None:
            self.sizer.observe(prefill_tokens, decodes, seconds)

    def _waits_for_blocks(self, req: Request) -> bool:
        """Whether a request alone and out of blocks waits for those others hold for a while
        (reservations for KV on its way, a finished prompt's blocks kept for its send): only
        where the whole pool could hold it, and for BLOCKS_WAIT_S at most (two workers' lone
        requests may each wait on blocks that a prefill queued behind the other would free)."""
        if not (self.waiting_for_kv or self.held):
            return False
        if cdiv(req.num_tokens, self.kv.block_size) > self.kv.pool.num_blocks:
            return False
        now = time.monotonic()
        if req.blocks_wait_since is None:
            req.blocks_wait_since = now
        return now - req.blocks_wait_since < BLOCKS_WAIT_S

    def _admit_waiting(self, budget: int, chunks: dict[str, int], fill_cap: int | None) -> int:
        admitted = 0
        while self.waiting and budget > 0 and self.num_seq_slots_used < self.config.max_num_seqs:
            req = self.waiting[0]
            if cdiv(req.num_tokens, self.kv.block_size) > self.kv.pool.num_blocks:
                self._end_for_capacity(req)  # grew past the whole pool while preempted
                continue
            computed = (
                self.kv.get_computed_blocks(req) if not req.block_ids else ComputedBlocks([], 0)
            )
            remaining = req.num_tokens - req.num_computed_tokens - computed.num_tokens
            if not self.config.enable_chunked_prefill and remaining > budget:
                # Unchunked: the whole prompt in one step, past the budget if it must, next to
                # the running decodes, which stall for it (the interference chunking avoids).
                # Never two prompts past the budget in one step.
                if admitted:
                    break
                n = remaining
            else:
                n = min(remaining, budget, self.kv.free_slots(req, computed))
                if n < 1:
                    break
            if not self.kv.allocate_slots(req, n, computed):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            chunks[req.request_id] = n
            admitted += 1
            budget = max(0, budget - n)
            if fill_cap is not None and n == remaining:
                budget = min(budget, fill_cap)  # it completes here
        return budget

    def _build_output(self, chunks: dict[str, int], preempted: list[str]) -> SchedulerOutput:
        scheduled = []
        prompt_rows = False
        for rid, n in chunks.items():
            req = self.requests[rid]
            start = req.num_computed_tokens
            sample = start + n == req.num_tokens
            penalized = sample and req.sampling.penalized
            s = ScheduledRequest(
                request_id=rid,
                token_ids=tuple(req.token_ids[start : start + n]),
                start_pos=start,
                block_ids=tuple(req.block_ids),
                sample=sample,
                sampling=req.sampling,
                seen=seen(req) if penalized else None,
            )
            # The field first: a request that asks for none costs one read a step.
            if req.sampling.prompt_logprobs is not None and req.prompt_logprobs_due:
                targets, first = _prompt_targets(req, start, n)
                if targets:
                    s = s._replace(prompt_targets=targets, prompt_from=first)
                    prompt_rows = True
            scheduled.append(s)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_batched_tokens=sum(chunks.values()),
            preempted_request_ids=tuple(preempted),
            finished_request_ids=finished,
            prompt_rows=prompt_rows,
        )

    def _check_invariants(self, out: SchedulerOutput) -> None:
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "request scheduled twice"
        prompts = [s for s in out.scheduled if len(s.token_ids) > 1]
        unchunked_one = not self.config.enable_chunked_prefill and len(prompts) == 1
        assert unchunked_one or out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert self.num_seq_slots_used <= self.config.max_num_seqs
        for r in self.running:
            assert r.num_tokens > r.num_computed_tokens, f"{r.request_id} has nothing left to run"
        for r in self.waiting:
            assert not r.block_ids, f"waiting {r.request_id} holds blocks"
        for rid, r in self.waiting_for_kv.items():
            assert r.status is RequestStatus.WAITING_FOR_KV and r not in self.running, rid
            need = cdiv(r.num_prompt_tokens, self.kv.block_size)
            assert len(r.block_ids) >= need, f"{rid} waits for KV without blocks for its prompt"
        for rid in self.held:
            assert rid not in self.requests, f"held {rid} is also live"
        for s in out.scheduled:
            need = cdiv(s.start_pos + len(s.token_ids), self.kv.block_size)
            assert len(s.block_ids) >= need, f"{s.request_id}: {len(s.block_ids)} < {need} blocks"
            assert self.requests[s.request_id].status is RequestStatus.RUNNING


def _prompt_targets(req: Request, start: int, n: int) -> tuple[tuple[int, ...], int]:
    """For a request whose prompt logprobs are due: the prompt tokens whose logprobs a chunk of
    `n` tokens from `start` computes (each position p gives token p + 1's), and the chunk index
    of the first such position; none where the chunk holds no position it lacks (or starts past
    them: the prefix cache gives it no more than the positions it has logprobs for)."""
    have = len(req.prompt_logprobs)
    lo = max(start, have)
    hi = min(start + n, req.num_prompt_tokens - 1)
    if lo >= hi or start > have:
        return (), 0
    return tuple(req.token_ids[lo + 1 : hi + 1]), lo - start
