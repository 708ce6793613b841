"""A prefill worker killed mid-prefill (half its prompt still to compute, no KV sent yet) or
mid-transfer (half the KV's layers out), with another prefill worker up: the request is re-planned
onto that one for the same decode worker, its KV moves from there (no local prefill), its greedy
output is transformers' own, the dead worker is replaced and every pool is full at the end."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kv_transfer.faults import FaultKind, FaultPlan
from router.cluster import Cluster
from router.vocab import FallbackReason
from router.workers import WorkerStatus
from tests.fault.clusters import MAX_NEW, MODEL, cluster, pools_full, received, run
from tests.helpers import hf_greedy, random_prompts
from worker_protocol.messages import WorkerRole

LAYERS = 4  # tiny-llama's
WARM = random_prompts([17], seed=172)[0]


def warm_up(c: Cluster) -> None:
    """One request through prefill-0: its first send (a FaultPlan with every=2 spares it)."""
    got = asyncio.run(asyncio.wait_for(run(c, WARM, "warm", prefill_worker="prefill-0"), 60))
    assert got == hf_greedy(MODEL, WARM, MAX_NEW)


class Heard:
    """A HandoffListener that keeps what the cluster told it."""

    def __init__(self) -> None:
        self.replans: list[tuple[str, str]] = []
        self.fallbacks: list[object] = []
        self.sends_ok: list[bool] = []

    def prefilled(self, result) -> None:
        self.sends_ok.append(result.transfer_ok)

    def fell_back(self, reason, detail, wasted_s) -> None:
        self.fallbacks.append(reason)

    def replanned(self, dead, to, detail, wasted_s) -> None:
        self.replans.append((dead, to))


def replanned(c: Cluster, old_pid: int, heard: Heard, ledger) -> None:
    """The struck request went to prefill-1, its KV landed, and prefill-0 came back."""
    assert c.replans == 1
    assert heard.replans == [("prefill-0", "prefill-1")] and not heard.fallbacks
    assert heard.sends_ok == [True]  # prefill-1's answer: its send ended well
    assert not c.fallbacks  # its KV came from prefill-1: nothing was prefilled locally
    ok, failed = received(c)
    assert (ok, failed) == (2, 1)  # the warm-up and the re-planned one; the struck receive
    deadline = time.monotonic() + 60  # the dead one comes back under its id
    while "prefill-0" not in c.prefill_ids or c.worker_info("prefill-0").pid == old_pid:
        assert time.monotonic() < deadline, "prefill-0 was not replaced"
        time.sleep(0.1)
    assert c.restarts[WorkerRole.PREFILL] == 1
    pools_full(c)
    ledger.add(injected=1)


@pytest.mark.timeout(240)
def test_killed_mid_transfer_the_request_is_replanned_onto_another_prefill_worker(ledger):
    # prefill-0's second send exits its process once half the layers went out.
    c = cluster(FaultPlan(FaultKind.KILL, every=2, after_layers=LAYERS // 2), num_prefill=2)
    try:
        prompt = random_prompts([251], seed=171)[0]
        old = c.worker_info("prefill-0").pid
        heard = Heard()
        ledger.add(sent=2)
        warm_up(c)
        t0 = time.monotonic()
        got = asyncio.run(
            asyncio.wait_for(
                run(c, prompt, "struck", prefill_worker="prefill-0", on_prefill=heard), 60
            )
        )
        assert got == hf_greedy(MODEL, prompt, MAX_NEW)
        ledger.add(completed=2)
        assert time.monotonic() - t0 < 30
        replanned(c, old, heard, ledger)
    finally:
        c.shutdown()


@pytest.mark.timeout(240)
def test_killed_mid_prefill_the_request_is_replanned_onto_another_prefill_worker(ledger):
    # Chunks of 8 tokens: a 900-token prompt takes over a hundred steps to prefill, and its KV
    # goes out only in the last one.
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8),
    )
    c = cluster(None, num_prefill=2, engine=engine)
    try:
        prompt = random_prompts([900], seed=173)[0]
        p0 = c.actor("prefill-0")
        old = c.worker_info("prefill-0").pid
        heard = Heard()
        ledger.add(sent=2)
        warm_up(c)
        out: list[list[int]] = []
        t = threading.Thread(
            target=lambda: out.append(
                asyncio.run(
                    asyncio.wait_for(
                        run(c, prompt, "struck", prefill_worker="prefill-0", on_prefill=heard), 90
                    )
                )
            )
        )
        t.start()
        deadline = time.monotonic() + 30
        while True:  # strike once it is prefilling, half its prompt still to compute
            ld = ray.get(p0.load.remote(), timeout=10)
            if ld.running and ld.queued_prefill_tokens >= len(prompt) // 2:
                assert ld.open_transfers == 0  # no KV has gone out yet
                os.kill(old, signal.SIGKILL)
                break
            assert time.monotonic() < deadline, f"prefill-0 never ran it: {ld}"
            time.sleep(0.002)
        t.join(120)
        assert out == [hf_greedy(MODEL, prompt, MAX_NEW)]
        ledger.add(completed=2)
        replanned(c, old, heard, ledger)
    finally:
        c.shutdown()


@pytest.mark.timeout(240)
def test_a_re_plan_onto_a_worker_a_resize_began_to_remove_leaves_the_prompt_to_the_decode_worker(
    ledger,
):
    """The re-plan after prefill-0 dies picks prefill-1; a resize marks prefill-1 DRAINING while
    the router still waits for the decode worker to drop the first reservation. The request
    must not start on prefill-1 (its drain may already have found it idle): the decode worker
    prefills it, and prefill-1 never saw it."""
    c = cluster(FaultPlan(FaultKind.KILL, every=2, after_layers=LAYERS // 2), num_prefill=2)
    try:
        prompt = random_prompts([251], seed=174)[0]
        old = c.worker_info("prefill-0").pid
        p1 = c.pools.workers["prefill-1"]
        heard = Heard()
        ledger.add(sent=2)
        warm_up(c)
        abort_on = c.handoffs._abort_on

        async def resize_meanwhile(h, rid):
            if h.worker_id == "decode-0":
                p1.status = WorkerStatus.DRAINING  # as Pools.scale marks it
            return await abort_on(h, rid)

        c.handoffs._abort_on = resize_meanwhile  # type: ignore[method-assign]
        got = asyncio.run(
            asyncio.wait_for(
                run(c, prompt, "struck", prefill_worker="prefill-0", on_prefill=heard), 60
            )
        )
        c.handoffs._abort_on = abort_on  # type: ignore[method-assign]
        p1.status = WorkerStatus.READY
        assert got == hf_greedy(MODEL, prompt, MAX_NEW)
        ledger.add(completed=2, injected=1)
        assert c.replans == 0 and not heard.replans and p1.active == 0
        assert heard.fallbacks == [FallbackReason.PREFILL_FAILED]
        assert "prefill-1: it is leaving its pool" in c.fallbacks[0][2]
        sent = asyncio.run(c.kv_stats())["prefill-1"]
        assert (sent.ok, sent.failed) == (0, 0)  # prefill-1 sent nothing
        deadline = time.monotonic() + 60  # the dead one comes back under its id
        while "prefill-0" not in c.prefill_ids or c.worker_info("prefill-0").pid == old:
            assert time.monotonic() < deadline, "prefill-0 was not replaced"
            time.sleep(0.1)
        pools_full(c)
    finally:
        c.shutdown()
