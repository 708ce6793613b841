"""A stream from a worker that hangs mid-stream (its process stopped: SIGSTOP), through Cluster
as a Python program uses it, with no server and so no load poll: the stream's own watch finds
the worker hung (silent, then no answer to a ping within the hang timeout) and stops it
(killed, then replaced, as the watchdog would); the stream ends with WorkerLost, on either
path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.errors import WorkerLost
from router.vocab import Placement, RoutePath
from router.worker_calls import HangWatch
from tests.helpers import hf_greedy, random_prompts
from tests.test_cluster import assert_pools_full

HANG_S = 3.0
PROMPT = random_prompts([21], seed=733)[0]


async def stop_mid_stream(cluster: Cluster, placement: Placement, pid: int) -> float:
    """Stream 900 tokens, stopping `pid` at the first; seconds from the stop to WorkerLost."""
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    stopped_at = None
    with pytest.raises(WorkerLost) as lost:
        async for chunk in cluster.generate(PROMPT, params, placement):
            if chunk.token_ids and stopped_at is None:
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
    assert stopped_at is not None and placement.decode_worker in str(lost.value), lost.value
    return time.monotonic() - stopped_at


def replaced(cluster: Cluster, worker: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (cluster.pools.workers[worker].incarnation == 1 and worker in cluster.decode_ids):
        assert time.monotonic() < deadline, cluster.pools.infos()
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_a_stream_from_a_worker_stopped_mid_stream_ends_and_the_worker_is_replaced():
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )
    c = Cluster(
        ClusterConfig(
            model="tiny-llama", num_prefill=1, num_decode=2, engine=engine,
            worker_hang_timeout_s=HANG_S,
        )
    )  # fmt: skip
    stopped: list[int] = []
    try:
        probe_s = HangWatch(c.pools, None, HANG_S).probe_s  # type: ignore[arg-type]
        bound = 2 * probe_s + HANG_S + 10  # silent, then a probe, its wait, the kill
        for path, worker in (
            (RoutePath.COLOCATED, "decode-0"),
            (RoutePath.DISAGGREGATED, "decode-1"),
        ):
            pid = c.worker_info(worker).pid
            stopped.append(pid)
            placement = Placement(path=path, decode_worker=worker)
            took = asyncio.run(asyncio.wait_for(stop_mid_stream(c, placement, pid), 60))
            assert took < bound, (path, took)
            replaced(c, worker)
        assert c.pools.hung == ["decode-0", "decode-1"]  # stopped as hung, not found dead
        # The replacements serve, token for token; every pool is full again.
        params = SamplingParams(max_tokens=8, temperature=0.0)
        for path, worker in (
            (RoutePath.COLOCATED, "decode-0"),
            (RoutePath.DISAGGREGATED, "decode-1"),
        ):

            async def one(path=path, worker=worker) -> list[int]:
                placement = Placement(path=path, decode_worker=worker)
                return [
                    t async for ch in c.generate(PROMPT, params, placement) for t in ch.token_ids
                ]

            assert asyncio.run(asyncio.wait_for(one(), 60)) == hf_greedy("tiny-llama", PROMPT, 8)
        assert_pools_full(c)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        c.shutdown()
