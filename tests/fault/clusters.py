"""A cluster of Ray workers whose KV sends suffer a FaultPlan, and what the fault tests read of
it: a request's greedy tokens, the decode worker's receive totals, and whether every pool is full
(nothing running, waiting, held or in transfer)."""

from __future__ import annotations

import asyncio
import time

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from kv_transfer.faults import FaultPlan
from router.cluster import Cluster, ClusterConfig
from router.core_types import HandoffListener
from router.vocab import Placement, RoutePath

MODEL = "tiny-llama"
MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def cluster(plan: FaultPlan | None, engine: EngineConfig | None = None, **kw) -> Cluster:
    engine = engine or EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )
    return Cluster(
        ClusterConfig(model=MODEL, engine=engine, kv_transfer_deadline_s=3, kv_faults=plan, **kw)
    )


async def run(
    c: Cluster,
    prompt: list[int],
    rid: str,
    prefill_worker: str | None = None,
    on_prefill: HandoffListener | None = None,
) -> list[int]:
    """A disaggregated request's greedy tokens."""
    placement = Placement(
        path=RoutePath.DISAGGREGATED, request_id=rid, prefill_worker=prefill_worker
    )
    stream = c.generate(prompt, GREEDY, placement, on_prefill)
    return [t async for chunk in stream for t in chunk.token_ids]


def pools_full(c: Cluster, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        loads = asyncio.run(c.load())
        busy = [
            ld for ld in loads
            if ld.num_free_blocks != ld.num_blocks or ld.running or ld.waiting
            or ld.waiting_for_kv or ld.held or ld.open_transfers
        ]  # fmt: skip
        if not busy:
            return
        assert time.monotonic() < end, busy
        time.sleep(0.1)


def received(c: Cluster, worker: str = "decode-0") -> tuple[int, int]:
    s = asyncio.run(c.kv_stats())[worker]
    return s.ok, s.failed
