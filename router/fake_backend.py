"""A stand-in for the Ray pools that answers at once, for measuring the router alone (its
overhead benchmark) and for testing the request core without workers.

Each request yields `max_tokens` tokens (token id i % vocab) in chunks of `chunk_tokens`, after
an optional `gate` (an asyncio.Event) is set; it reports the same load every time. With
`fallback`, every disaggregated request's handoff falls back for that reason (and with
`fail_handoffs` then ends, as under --kv-failure-policy fail). With `replan`, every
disaggregated request's prefill worker "dies" and it is re-planned onto another. With
`lose_decode_after`, the first request to have streamed that many tokens loses its decode worker
(WorkerLost, once), as when one dies. With `hits` (prefill worker's, decode worker's), each
handoff's prefill worker answers (its KV sent) with the first as its prefix-cache hit (a
`fallback` then comes after: the KV never reached the decode worker), and every chunk carries the
second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence

from engine.device_rate import DeviceRate
from engine.sampling_params import SamplingParams
from router.core_types import HandoffListener
from router.errors import HandoffFailed, WorkerLost
from router.vocab import FallbackReason, Placement, RoutePath
from worker_protocol.messages import (
    PrefillResult,
    TokenChunk,
    WorkerInfo,
    WorkerLoad,
    WorkerRole,
)


def fake_info(
    worker_id: str, role: WorkerRole, vocab_size: int = 512, max_model_len: int = 4096
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_params=1_000_000,
        weight_bytes=4_000_000,
        kv_bytes_per_token=2 * 4 * 2 * 16 * 4,
        block_size=16,
        num_blocks=1024,
        max_num_batched_tokens=512,
        max_num_seqs=64,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        rate=DeviceRate(flops_per_s=1e11, bytes_per_s=1e10),
    )


class FakeBackend:
    def __init__(
        self,
        num_prefill: int = 1,
        num_decode: int = 1,
        vocab_size: int = 512,
        chunk_tokens: int = 1,
        gate: asyncio.Event | None = None,
        fallback: FallbackReason | None = None,
        fail_handoffs: bool = False,
        replan: bool = False,
        lose_decode_after: int | None = None,
        num_both: int = 0,
        hits: tuple[int, int] | None = None,
    ) -> None:
        both = [f"both-{i}" for i in range(num_both)]  # in both lists, as in the pools
        self.prefill_ids = [f"prefill-{i}" for i in range(num_prefill)] + both
        self.decode_ids = [f"decode-{i}" for i in range(num_decode)] + both
        self.dead: list[str] = []
        self.hung: list[str] = []
        self.silent: set[str] = set()
        self.restarts: dict[WorkerRole, int] = {}
        self.vocab_size = vocab_size
        self.chunk_tokens = chunk_tokens
        self.gate = gate
        self.fallback = fallback
        self.fail_handoffs = fail_handoffs  # a fallback then ends the request (policy "fail")
        self.replan = replan
        self.lose_decode_after = lose_decode_after
        self.hits = hits
        self.lost: list[str] = []  # request ids whose decode worker "died" under them
        self.started: list[str] = []  # request ids, in the order they reached the backend
        self.placements: list[Placement] = []  # as they reached the backend
        self.sampling: list[SamplingParams] = []  # each generate call's, in order
        self.closed: list[str] = []  # request ids whose stream ended, for any reason
        self.step_targets: dict[str, float | None] = {}  # as set by the router, by worker

    def worker_info(self, worker_id: str) -> WorkerInfo:
        role = WorkerRole(worker_id.rsplit("-", 1)[0])
        return fake_info(worker_id, role, self.vocab_size)

    def _ids(self) -> list[str]:
        return list(dict.fromkeys([*self.prefill_ids, *self.decode_ids]))

    def set_step_target(
        self, worker_id: str, target_s: float | None, seq: int = 0
    ) -> Awaitable[None]:
        self.step_targets[worker_id] = target_s
        return asyncio.sleep(0)

    async def infos(self) -> list[WorkerInfo]:
        return [self.worker_info(w) for w in self._ids()]

    async def load(self, wait_s: float | None = None) -> list[WorkerLoad]:
        return [
            WorkerLoad(w, self.worker_info(w).role, 0, 0, 0, 0.0, 1024, 1024, 0)
            for w in self._ids()
        ]

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        placement: Placement,
        on_prefill: HandoffListener | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        rid = placement.request_id
        worker = placement.decode_worker
        if worker and worker not in self.decode_ids and params.max_tokens > 1:
            # as PrefillWorker.generate: a prefill worker answers requests of one token only
            raise ValueError(f"{worker} answers one token, not {params.max_tokens}")
        self.started.append(rid)
        self.placements.append(placement)
        self.sampling.append(params)
        handoff = on_prefill if placement.path is RoutePath.DISAGGREGATED else None
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.replan and handoff is not None:
                dead = placement.prefill_worker or self.prefill_ids[0]
                to = next(w for w in self.prefill_ids if w != dead)
                handoff.replanned(dead, to, "fake", 0.0)
            if handoff is not None and self.hits is not None:
                hit = self.hits[0]
                sent = PrefillResult(rid, 0, None, True, 0.0, 0.0, 0, num_cached_tokens=hit)
                handoff.prefilled(sent)
            if self.fallback is not None and handoff is not None:
                # (after `hits`' answer: its KV sent, then not received)
                handoff.fell_back(self.fallback, "fake", 0.0)
                if self.fail_handoffs:
                    raise HandoffFailed(self.fallback.value, "fake")
            n = params.max_tokens
            for start in range(0, n, self.chunk_tokens):
                if self._loses_decode(start):
                    self.lost.append(rid)
                    raise WorkerLost(placement.decode_worker or "decode-0", "fake")
                end = min(n, start + self.chunk_tokens)
                ids = tuple(i % self.vocab_size for i in range(start, end))
                last = start + self.chunk_tokens >= n
                yield TokenChunk(
                    request_id=rid,
                    token_ids=ids,
                    finished=last,
                    finish_reason="length" if last else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=self.hits[1] if self.hits else 0,
                    worker_id=placement.decode_worker or "",
                    emitted_at=time.monotonic(),
                )
        finally:
            self.closed.append(rid)

    def _loses_decode(self, streamed: int) -> bool:
        after = self.lose_decode_after
        return after is not None and streamed >= after and not self.lost
