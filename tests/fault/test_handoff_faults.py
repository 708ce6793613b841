"""Faults in the KV handoff between Ray workers (kv_transfer/faults.py, on the prefill workers'
sends): every request still completes with transformers' greedy output under `recompute`, or gets
UNAVAILABLE under `fail`; each fallback is counted with its reason; no wait outlives its
deadline; every pool is full at the end."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from kv_transfer.faults import FaultKind, FaultPlan
from router.errors import HandoffFailed
from router.vocab import FallbackReason
from tests.fault.clusters import MAX_NEW, MODEL, cluster, pools_full, received, run
from tests.helpers import hf_greedy, random_prompts


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "plan, reason",
    [
        (FaultPlan(FaultKind.CORRUPT), "corrupt"),
        (FaultPlan(FaultKind.DROP), "timeout"),
        (FaultPlan(FaultKind.DELAY, delay_s=4.0), "timeout"),
        (FaultPlan(FaultKind.BREAK, after_layers=1), "peer_dead"),
    ],
    ids=["corrupt", "drop", "delay", "break"],
)
def test_every_request_completes_through_a_failed_transfer(plan, reason, ledger):
    c = cluster(plan)
    try:
        prompts = random_prompts([23, 37, 14], seed=151)
        for i, prompt in enumerate(prompts):
            if plan.kind is FaultKind.BREAK:  # the pair comes back in the background
                deadline = time.monotonic() + 30
                while not c.pools.pairs.connected("prefill-0", "decode-0"):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            t0 = time.monotonic()
            ledger.add(sent=1)
            got = asyncio.run(asyncio.wait_for(run(c, prompt, f"r{i}"), 60))
            assert got == hf_greedy(MODEL, prompt, MAX_NEW)
            ledger.add(completed=1)
            # A failed handoff waits at most its transfer deadline (3 s) before recomputing.
            assert time.monotonic() - t0 < 3 + 4.0 + 3
        ok, failed = received(c)
        assert ok == 0 and failed == len(prompts)  # every receive failed: the fault struck
        ledger.add(injected=failed)
        stats = asyncio.run(c.kv_stats())["decode-0"]
        assert {r.value for r in stats.failures} <= {reason, "peer_aborted"}, stats.failures
        whys = [why for _, why, _ in c.fallbacks]
        assert len(whys) == len(prompts)
        assert set(whys) <= {FallbackReason.TRANSFER_FAILED, FallbackReason.PAIR_NOT_READY}
        pools_full(c)
    finally:
        c.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_worker_killed_mid_transfer_is_replaced_and_the_request_ends_by_policy(
    policy, ledger
):
    # The only prefill worker: nothing to re-plan onto.
    c = cluster(FaultPlan(FaultKind.KILL, after_layers=1), kv_failure_policy=policy)
    try:
        prompt = random_prompts([61], seed=152)[0]
        old = c.worker_info("prefill-0")
        ledger.add(sent=1)
        if policy == "recompute":
            got = asyncio.run(asyncio.wait_for(run(c, prompt, "killed"), 60))
            assert got == hf_greedy(MODEL, prompt, MAX_NEW)
            ledger.add(completed=1, injected=1)
        else:
            with pytest.raises(HandoffFailed) as err:
                asyncio.run(asyncio.wait_for(run(c, prompt, "killed"), 60))
            assert err.value.reason == "prefill_failed"
            ledger.add(failed=1, injected=1)
        assert [why for _, why, _ in c.fallbacks] == [FallbackReason.PREFILL_FAILED]
        assert c.replans == 0
        ok, failed = received(c)
        assert (ok, failed) == (0, 1)  # killed while its KV was in flight
        deadline = time.monotonic() + 60
        while c.prefill_ids != ["prefill-0"] or c.worker_info("prefill-0").pid == old.pid:
            assert time.monotonic() < deadline, "prefill-0 was not replaced"
            time.sleep(0.1)
        assert c.dead == ["prefill-0"]
        pools_full(c)
    finally:
        c.shutdown()


@pytest.mark.timeout(180)
def test_under_the_fail_policy_a_failed_transfer_ends_the_request_and_frees_both_pools(ledger):
    c = cluster(FaultPlan(FaultKind.CORRUPT), kv_failure_policy="fail")
    try:
        ledger.add(sent=1)
        with pytest.raises(HandoffFailed) as err:
            asyncio.run(asyncio.wait_for(run(c, random_prompts([29], seed=153)[0], "x"), 60))
        assert err.value.reason == "transfer_failed"
        ledger.add(failed=1, injected=1)
        pools_full(c)
        assert ray.get(c.actor("decode-0").kv_stats.remote()).failed == 1
    finally:
        c.shutdown()


@pytest.mark.timeout(240)
def test_a_decode_worker_lost_while_its_handoff_prefills_ends_it_at_once(ledger):
    """The decode worker dies while the prefill worker is held mid-prefill (stopped, as a busy
    one is slow): once the pool knows it is dead, the handoff ends (WorkerLost: the request
    core resumes it elsewhere) and the prefill is aborted, rather than run to its end and its KV
    sent towards the dead worker (or a replacement under its id), then fall back to it."""
    import os
    import signal
    import threading

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from router.cluster import Cluster, ClusterConfig
    from router.errors import WorkerLost
    from router.vocab import Placement, RoutePath
    from router.workers import WorkerStatus
    from tests.fault.clusters import GREEDY

    engine = EngineConfig(  # a 900-token prompt takes over a hundred steps to prefill
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8),
    )
    c = Cluster(ClusterConfig(model=MODEL, engine=engine, num_decode=2))
    try:
        warm = random_prompts([17], seed=175)[0]
        assert asyncio.run(run(c, warm, "warm")) == hf_greedy(MODEL, warm, MAX_NEW)
        ledger.add(sent=2, completed=1, injected=1)  # the kill
        sent_before = asyncio.run(c.kv_stats())["prefill-0"]
        prompt = random_prompts([900], seed=176)[0]
        placement = Placement(
            path=RoutePath.DISAGGREGATED,
            request_id="struck",
            prefill_worker="prefill-0",
            decode_worker="decode-0",
        )
        ended: list[tuple[float, BaseException | None]] = []

        async def consume() -> None:
            async for _ in c.generate(prompt, GREEDY, placement):
                pass

        def go() -> None:
            try:
                asyncio.run(asyncio.wait_for(consume(), 90))
                ended.append((time.monotonic(), None))
            except BaseException as exc:
                ended.append((time.monotonic(), exc))

        t = threading.Thread(target=go)
        t.start()
        p0, p0_pid = c.actor("prefill-0"), c.worker_info("prefill-0").pid
        d0 = c.pools.workers["decode-0"]
        victim = c.worker_info("decode-0").pid
        deadline = time.monotonic() + 30
        while True:  # strike once it prefills, most of its prompt still to compute
            ld = ray.get(p0.load.remote(), timeout=10)
            if ld.running and ld.queued_prefill_tokens >= len(prompt) // 2:
                break
            assert time.monotonic() < deadline and t.is_alive(), ld
            time.sleep(0.002)
        os.kill(p0_pid, signal.SIGSTOP)
        try:
            os.kill(victim, signal.SIGKILL)
            try:  # what a load poll of it meets
                ray.get(d0.actor.load.remote(), timeout=30)
                raise AssertionError("decode-0 answered after its kill")
            except ray.exceptions.RayActorError as exc:
                assert c.pools.note_failure(d0, exc)
            assert d0.status is WorkerStatus.DEAD
            noted = time.monotonic()
            time.sleep(1.0)  # the handoff sees it gone meanwhile; prefill-0 is still stopped
        finally:
            os.kill(p0_pid, signal.SIGCONT)
        t.join(60)
        assert not t.is_alive()
        ((at, exc),) = ended
        assert isinstance(exc, WorkerLost) and exc.worker_id == "decode-0", exc
        assert at - noted < 10  # the abort on prefill-0 answered once it went on
        ledger.add(failed=1)  # here; under the request core, it resumes on decode-1
        assert not c.fallbacks  # nothing was left to the dead worker to prefill
        sent = asyncio.run(c.kv_stats())["prefill-0"]
        assert (sent.ok, sent.failed) == (sent_before.ok, sent_before.failed)  # no send began
        deadline = time.monotonic() + 60  # the dead one comes back under its id
        while "decode-0" not in c.decode_ids or c.worker_info("decode-0").pid == victim:
            assert time.monotonic() < deadline, "decode-0 was not replaced"
            time.sleep(0.1)
        pools_full(c, timeout_s=30)
    finally:
        c.shutdown()
