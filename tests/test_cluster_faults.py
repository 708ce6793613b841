"""Worker deaths in the middle of a handoff: the survivor's transfer ends FAILED within its
deadline and the survivor's blocks are freed (1 prefill + 1 decode worker, tiny model)."""

import asyncio
import time

import pytest
import ray

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.errors import WorkerLost
from router.vocab import FallbackReason, Placement, RoutePath
from router.workers import WorkerStatus
from tests.helpers import hf_greedy, random_prompts
from worker_protocol.messages import WorkRequest

BLOCK = 4


def make_cluster():
    engine = EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )
    return Cluster(
        ClusterConfig(
            model="tiny-llama",
            engine=engine,
            kv_transfer_deadline_s=5,
            prefill_timeout_s=5,
            replace_dead=False,  # these tests watch the survivor, not a replacement
        )
    )


def reserve(c, rid, prompt):
    """Step 1 of the disaggregated path, done by hand so the test picks when to kill."""
    req = WorkRequest(rid, tuple(prompt), SamplingParams(max_tokens=4, temperature=0.0))
    d, p = c.actor("decode-0"), c.actor("prefill-0")
    assert c.pools.pairs.connected("prefill-0", "decode-0")  # paired before taking load
    target = ray.get(d.reserve_kv.remote(req, "prefill-0"))
    assert target.skip_blocks == 0
    return req, d, p, target


def wait_full(actor, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        load = ray.get(actor.load.remote())
        idle = (
            load.running == load.waiting == load.waiting_for_kv == load.held == 0
            and load.open_transfers == 0
        )
        if load.num_free_blocks == load.num_blocks and idle:
            return load
        time.sleep(0.1)
    raise AssertionError(f"pool not full after {timeout} s: {load}")


@pytest.mark.timeout(120)
def test_decode_worker_killed_before_the_send_frees_prefill_blocks():
    c = make_cluster()
    try:
        req, d, p, res = reserve(c, "kill-d", random_prompts([40], seed=71)[0])
        ray.kill(d)
        t0 = time.monotonic()
        result = ray.get(p.prefill.remote(req, "decode-0", res.dst_block_ids, 0), timeout=30)
        assert not result.transfer_ok and result.error
        assert time.monotonic() - t0 < 5 + 5  # within the transfer deadline (plus slack)
        wait_full(p)
        assert ray.get(p.kv_stats.remote()).failed == 1
        # Not replaced (replace_dead=False): once noticed, it leaves the pools with its pair.
        asyncio.run(c.load())
        deadline = time.monotonic() + 10
        while "decode-0" in c.pools.workers:
            assert time.monotonic() < deadline, c.pools.workers
            time.sleep(0.05)
        assert c.dead == ["decode-0"] and c.decode_ids == []
        assert c.pools.pairs.state("prefill-0", "decode-0") is None
    finally:
        c.shutdown()


@pytest.mark.timeout(120)
def test_prefill_worker_killed_fails_the_receive_and_frees_decode_blocks():
    c = make_cluster()
    try:
        prompt = random_prompts([40], seed=72)[0]
        req, d, p, res = reserve(c, "kill-p", prompt)
        assert ray.get(d.load.remote()).waiting_for_kv == 1
        ray.kill(p)
        t0 = time.monotonic()
        while ray.get(d.kv_stats.remote()).failed == 0:  # the pair sees its peer die
            assert time.monotonic() - t0 < 10, "receive still open 10 s after its peer died"
            time.sleep(0.1)

        async def finish():  # no first token will come: the decode worker recomputes
            toks = []
            async for ref in d.finish_handoff.options(num_returns="streaming").remote(
                "kill-p", None
            ):
                toks.extend((await ref).token_ids)
            return toks

        assert len(asyncio.run(asyncio.wait_for(finish(), 30))) == 4
        wait_full(d)
    finally:
        c.shutdown()


@pytest.mark.timeout(120)
def test_broken_pair_is_made_again():
    c = make_cluster()
    try:
        prompts = random_prompts([20, 28, 36], seed=73)
        sp = SamplingParams(max_tokens=4, temperature=0.0)

        async def run(prompt, rid):
            placement = Placement(path=RoutePath.DISAGGREGATED, request_id=rid)
            return [t async for ch in c.generate(prompt, sp, placement) for t in ch.token_ids]

        d, p = c.actor("decode-0"), c.actor("prefill-0")
        asyncio.run(run(prompts[0], "first"))  # over the pair made at start
        ray.get(d.disconnect.remote("prefill-0"))  # the pair breaks, one end
        asyncio.run(run(prompts[1], "broken"))  # its transfer fails: recomputed, pair lost
        assert [(rid, why) for rid, why, _ in c.fallbacks] == [
            ("broken", FallbackReason.TRANSFER_FAILED)
        ]
        # Made again in the background, within the pairing timeout (bounded wait).
        deadline = time.monotonic() + 15
        while not c.pools.pairs.connected("prefill-0", "decode-0"):
            assert time.monotonic() < deadline, c.pools.pairs.why_not("prefill-0", "decode-0")
            time.sleep(0.05)
        # A call of the first attempt (the router numbers them from 1) that runs only now
        # leaves the new pair alone.
        ray.get(d.disconnect.remote("prefill-0", 1))
        assert ray.get(d.connected.remote("prefill-0"))
        asyncio.run(run(prompts[2], "again"))  # the KV travels again
        assert [rid for rid, _, _ in c.fallbacks] == ["broken"]
        assert ray.get(d.kv_stats.remote()).ok == 2
        wait_full(d)
        wait_full(p)
    finally:
        c.shutdown()


def stream(method, *args) -> list:
    """Every chunk of one of a worker's streaming calls (bounded wait)."""

    async def run():
        return [await ref async for ref in method.options(num_returns="streaming").remote(*args)]

    return asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.timeout(120)
def test_calls_that_run_after_their_abort_do_nothing():
    """Ray runs an async actor's calls out of order, so the router's abort (the client left) may
    run before the reserve_kv, prefill, generate or finish_handoff it ends. Each of those then
    does nothing: no reservation or receive is left that nobody will end, and no prompt is
    computed for nobody. The router goes on with a request on a worker after aborting it there
    under a new id: the handoff under it decodes what a local prefill does."""
    c = make_cluster()
    try:
        d, p = c.actor("decode-0"), c.actor("prefill-0")
        prompt = tuple(random_prompts([40], seed=74)[0])
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        late = WorkRequest("late", prompt, sp)
        ray.get([d.abort.remote("late"), p.abort.remote("late")], timeout=30)  # they run first
        assert ray.get(d.reserve_kv.remote(late, "prefill-0"), timeout=30) is None
        load = ray.get(d.load.remote())
        assert (load.waiting_for_kv, load.open_transfers) == (0, 0)
        result = ray.get(p.prefill.remote(late, "decode-0", (0, 1, 2), 0), timeout=30)
        assert (result.first_token, result.error) == (None, "aborted")
        for chunks in (stream(d.generate, late), stream(d.finish_handoff, "late", 7)):
            assert [(ch.token_ids, ch.finished, ch.finish_reason) for ch in chunks] == [
                ((), True, "abort")
            ]
        sent = ray.get(p.kv_stats.remote())
        assert (sent.ok, sent.failed, sent.bytes_sent) == (0, 0, 0)  # no send began
        wait_full(d)
        wait_full(p)

        # A reset (an abort before the router goes on with the request here, as in a re-plan)
        # ends what the id held and the id for good; the request goes on under a new one.
        again = WorkRequest("again", prompt, sp)
        assert ray.get(d.reserve_kv.remote(again, "prefill-0"), timeout=30) is not None
        ray.get(d.abort.remote("again"), timeout=30)
        load = ray.get(d.load.remote())
        assert (load.waiting_for_kv, load.open_transfers) == (0, 0)
        assert ray.get(d.reserve_kv.remote(again, "prefill-0"), timeout=30) is None
        again = WorkRequest("again.1", prompt, sp)
        target = ray.get(d.reserve_kv.remote(again, "prefill-0"), timeout=30)
        assert target is not None
        result = ray.get(
            p.prefill.remote(again, "decode-0", target.dst_block_ids, target.skip_blocks),
            timeout=30,
        )
        assert result.transfer_ok, result.error
        handed = stream(d.finish_handoff, "again.1", result.first_token)
        local = stream(d.generate, WorkRequest("local", prompt, sp))
        tokens = [[t for ch in chunks for t in ch.token_ids] for chunks in (handed, local)]
        assert len(tokens[0]) == 4 and tokens[0] == tokens[1]
        assert not any(ch.kv_recomputed for ch in handed)  # the KV came over the pair
        wait_full(d)
        wait_full(p)
    finally:
        c.shutdown()


@pytest.mark.timeout(120)
def test_an_abort_while_a_handoff_waits_for_its_kv_ends_it_as_aborted():
    """finish_handoff waits on the decode worker for the KV; the client leaves meanwhile and the
    router's abort ends the receive and the reservation. The wait then ends at once, and the
    stream ends as aborted (not as an error from an engine that no longer knows the request),
    with every block free."""
    c = make_cluster()
    try:
        prompt = random_prompts([24], seed=78)[0]
        req, d, p, target = reserve(c, "wait", prompt)

        async def run():
            gen = d.finish_handoff.options(num_returns="streaming").remote("wait", 7)
            await asyncio.sleep(0.5)  # it waits for KV that no prefill sends
            t0 = time.monotonic()
            await d.abort.remote("wait")
            return [await ref async for ref in gen], time.monotonic() - t0

        chunks, took = asyncio.run(asyncio.wait_for(run(), 30))
        assert [(ch.token_ids, ch.finished, ch.finish_reason) for ch in chunks] == [
            ((), True, "abort")
        ]
        assert took < 3  # not at the transfer's 5 s deadline
        wait_full(d)
        wait_full(p)
    finally:
        c.shutdown()


@pytest.mark.timeout(120)
def test_a_request_that_meets_a_worker_stopped_by_a_resize_resumes_rather_than_fails():
    """A request that meets a stopped engine (a resize stops one once its drain sees nothing
    running there) reads that as a lost worker, which the router resumes on another, on either
    path: not as the request's own error. Here the handle still reads READY, as it would for a
    request that passed the check in generate before the drain began."""
    c = make_cluster()
    try:
        h = c.pools.workers["decode-0"]
        ray.get(h.actor.shutdown.remote(), timeout=30)  # as Pools.retire does, drained
        prompt = random_prompts([20], seed=75)[0]
        sp = SamplingParams(max_tokens=4, temperature=0.0)

        async def run(path: RoutePath, rid: str) -> None:
            placement = Placement(
                path=path, request_id=rid, prefill_worker="prefill-0", decode_worker="decode-0"
            )
            async for _ in c.generate(prompt, sp, placement):
                pass

        for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED):
            with pytest.raises(WorkerLost):
                asyncio.run(asyncio.wait_for(run(path, path.value), 30))
        assert not c.fallbacks  # the handoff's reserve_kv met it: lost, not a fallback there
        # Neither request left anything held: on the prefill worker (decode-0's engine is
        # stopped, its pool gone with it) nor in the router's counts of either worker.
        wait_full(c.actor("prefill-0"))
        assert c.pools.workers["prefill-0"].active == h.active == 0
    finally:
        c.shutdown()


@pytest.mark.timeout(120)
def test_a_request_placed_just_before_a_resize_began_does_not_start_on_the_leaving_worker():
    """A resize marks the workers it removes DRAINING and waits for what runs there; a request
    placed a moment before (the planner saw the worker READY) is not counted there yet, so the
    drain may find the worker idle. It must not start there: with its decode worker leaving it
    leaves at once, as a lost worker (the router resumes it elsewhere); with its prefill worker
    leaving, its decode worker prefills it. Nothing reaches the leaving worker."""
    c = make_cluster()
    try:
        prompt = random_prompts([20], seed=77)[0]
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        p, d = c.pools.workers["prefill-0"], c.pools.workers["decode-0"]

        async def run(path: RoutePath, rid: str) -> list[int]:
            placement = Placement(
                path=path, request_id=rid, prefill_worker="prefill-0", decode_worker="decode-0"
            )
            return [t async for ch in c.generate(prompt, sp, placement) for t in ch.token_ids]

        seen_p = wait_full(p.actor).prefix_queries  # the warm-up's
        d.status = WorkerStatus.DRAINING  # as Pools.scale marks it
        for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED):
            with pytest.raises(WorkerLost, match="decode-0 lost: it is leaving its pool"):
                asyncio.run(asyncio.wait_for(run(path, path.value), 30))
            assert p.active == d.active == 0
        d.status = WorkerStatus.READY
        seen_d = wait_full(d.actor).prefix_queries
        p.status = WorkerStatus.DRAINING
        local = asyncio.run(asyncio.wait_for(run(RoutePath.DISAGGREGATED, "p-leaving"), 30))
        assert p.active == d.active == 0
        p.status = WorkerStatus.READY
        assert [(rid, why.value, detail) for rid, why, detail in c.fallbacks] == [
            ("p-leaving", "no_prefill_worker", "prefill-0: it is leaving its pool")
        ]
        # Nothing reached P; D computed the one prompt; no KV moved.
        assert wait_full(p.actor).prefix_queries == seen_p
        assert wait_full(d.actor).prefix_queries == seen_d + len(prompt)
        assert ray.get(d.actor.kv_stats.remote()).ok == 0
        assert local == hf_greedy("tiny-llama", prompt, 4)
        # Back in the pool, an id sent nowhere before serves as any: the KV moves.
        prompt = random_prompts([24], seed=79)[0]
        handed = asyncio.run(run(RoutePath.DISAGGREGATED, "disaggregated"))
        assert handed == hf_greedy("tiny-llama", prompt, 4)
        assert ray.get(d.actor.kv_stats.remote()).ok == 1
        wait_full(d.actor)
        wait_full(p.actor)
    finally:
        c.shutdown()
