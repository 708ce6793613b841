"""Workers that both prefill and decode (`--workers`), beside dedicated pools, through Ray actors
on 127.0.0.1 (1 prefill, 1 decode, 2 of both; tiny model): every placement a request can get
gives transformers' greedy tokens, KV moves over one pair either way, and nothing leaks."""

import asyncio

import pytest
import ray

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.vocab import Placement, RoutePath
from tests.helpers import hf_greedy, random_prompts
from tests.test_cluster import assert_pools_full, gather, leave_after, received, run_one
from worker_protocol.messages import WorkerRole, WorkRequest

GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)

MAX_NEW = 10
COLO, DIS = RoutePath.COLOCATED, RoutePath.DISAGGREGATED


@pytest.fixture(scope="module")
def cluster():
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
    )
    cfg = ClusterConfig(
        model="tiny-llama",
        num_prefill=1,
        num_decode=1,
        num_both=2,
        engine=engine,
        kv_transfer_deadline_s=10,
    )
    c = Cluster(cfg)
    yield c
    c.shutdown()


def test_workers_of_both_kinds_take_either_role(cluster):
    assert cluster.prefill_ids == ["prefill-0", "both-0", "both-1"]
    assert cluster.decode_ids == ["decode-0", "both-0", "both-1"]
    assert cluster.worker_info("both-1").role is WorkerRole.BOTH
    # Where it runs, for the router's node share (router/host_share.py).
    info = cluster.worker_info("both-1")
    assert (info.device, info.node_ip) == ("cpu", "127.0.0.1")
    # How much of its blocks reservations for peers may hold, for auto's placements.
    assert info.reserve_share == 0.5 and cluster.worker_info("decode-0").reserve_share == 1.0
    pairs = cluster.pools.pairs
    for a, b in [("both-0", "both-1"), ("prefill-0", "both-0"), ("both-1", "decode-0")]:
        assert pairs.connected(a, b) and pairs.connected(b, a), (a, b)
    assert pairs.state("prefill-0", "decode-0") is not None
    with pytest.raises(ValueError, match="colocated"):
        Placement(path=DIS, prefill_worker="both-0", decode_worker="both-0")


@pytest.mark.timeout(150)
def test_every_placement_gives_transformers_tokens_and_moves_kv_either_way(cluster):
    """P = D on each worker of both kinds (colocated), and every P != D among all workers able
    to take each role, both directions between the two workers of both kinds at once, while
    those also decode their own colocated requests."""
    handoffs = [(p, d) for p in cluster.prefill_ids for d in cluster.decode_ids if p != d]
    assert (
        len(handoffs) == 7 and ("both-0", "both-1") in handoffs and ("both-1", "both-0") in handoffs
    )
    local = ["both-0", "both-1", "both-0"]
    prompts = random_prompts([5 + 4 * i for i in range(len(handoffs) + len(local))], seed=71)
    # Half of them bring a hold for their prompt (it waits for nothing here: no step target).
    jobs = [
        run_one(
            cluster,
            prompt,
            DIS,
            f"flex-dis-{i}",
            prefill_worker=p,
            decode_worker=d,
            prefill_hold_s=5.0 if i % 2 else None,
        )  # fmt: skip
        for i, ((p, d), prompt) in enumerate(zip(handoffs, prompts))
    ]
    jobs += [
        run_one(
            cluster,
            prompt,
            COLO,
            f"flex-colo-{i}",
            decode_worker=w,
            prefill_hold_s=5.0 if i % 2 else None,
        )  # fmt: skip
        for i, (w, prompt) in enumerate(zip(local, prompts[len(handoffs) :]))
    ]
    before = received(cluster)
    got = gather(jobs, timeout=120)
    after = received(cluster)
    assert not cluster.fallbacks
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy("tiny-llama", prompt, MAX_NEW), f"prompt of {len(prompt)}"
    # Every worker ended each transfer it took part in well (a worker of both kinds counts its
    # sends and its receives), none failed; each decode-capable one received KV.
    for w in after:
        want = sum(1 for p, d in handoffs if w in (p, d))
        ok, failed = after[w][1] - before[w][1], after[w][2] - before[w][2]
        assert (ok, failed) == (want, 0), w
    for d in cluster.decode_ids:
        assert after[d][0] > before[d][0], d
    stats = asyncio.run(cluster.kv_stats())
    for p in cluster.prefill_ids:
        assert stats[p].bytes_sent > 0, p
    assert_pools_full(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "where",
    [
        {"path": DIS, "prefill_worker": "both-0", "decode_worker": "both-1"},
        {"path": DIS, "prefill_worker": "prefill-0", "decode_worker": "both-0"},
        {"path": COLO, "decode_worker": "both-1"},
    ],
    ids=["both-to-both", "prefill-to-both", "colocated-on-both"],
)
def test_a_client_leaving_frees_both_sides(cluster, where):
    assert leave_after(cluster, random_prompts([30], seed=72)[0], Placement(**where), 3) >= 3
    assert_pools_full(cluster)


@pytest.mark.timeout(60)
def test_a_requests_hold_reaches_the_engine_on_every_way_in(cluster):
    """A WorkRequest's prefill_hold_s reaches the engine's request whichever way it comes in (a
    local prefill, a prefill for a peer, a reservation for KV): one out of range is refused
    there, naming the field, and the worker keeps serving."""
    bad = WorkRequest("bad-hold", (1, 2, 3, 4, 5), GREEDY_ONE, prefill_hold_s=-1.0)
    w = cluster.actor("both-0")
    calls = [
        lambda: ray.get(next(w.generate.options(num_returns="streaming").remote(bad))),
        lambda: ray.get(w.prefill.remote(bad, "both-1", (0, 1), 0)),
        lambda: ray.get(w.reserve_kv.remote(bad, "both-1")),
    ]
    for call in calls:
        with pytest.raises(Exception, match="prefill_hold_s"):
            call()
    prompt = random_prompts([9], seed=73)[0]
    got = gather([run_one(cluster, prompt, COLO, "after-bad-hold", decode_worker="both-0")])
    assert got[0] == hf_greedy("tiny-llama", prompt, MAX_NEW)
    assert_pools_full(cluster)


@pytest.mark.timeout(60)
def test_a_handoffs_kv_due_time_reaches_the_decode_workers_engine_through_ray(cluster):
    """A placement's kv_due_in_s travels from the router's cluster through the decode worker's
    actor to its engine's reservation (Scheduler.kv_due counts it only from then on), on a
    worker of both kinds receiving from a peer of the same kind; the tokens stay greedy."""

    def record_reservations(worker) -> None:
        """(Runs inside the worker's actor; defined here so that it travels by value.) Wrap its
        engine's reserve_for_kv to keep, per request, how far off its KV was set due."""
        import time

        engine = worker.engine
        plain = type(engine).reserve_for_kv.__get__(engine)
        worker.due_seen = {}

        def reserve_for_kv(prompt, params=None, request_id=None, *args, **kwargs):
            res = plain(prompt, params, request_id, *args, **kwargs)
            if res is not None:
                req = engine.scheduler.requests[request_id]
                worker.due_seen[request_id] = req.kv_due_at - time.monotonic()
            return res

        engine.reserve_for_kv = reserve_for_kv

    def stop_recording(worker) -> dict:
        del worker.engine.reserve_for_kv  # the class's own method again
        return worker.due_seen

    d = cluster.actor("both-1")
    before = received(cluster)["both-1"]
    ray.get(d.__ray_call__.remote(record_reservations), timeout=30)
    try:
        prompts = random_prompts([13, 17], seed=74)
        got = gather(
            [
                run_one(
                    cluster,
                    prompt,
                    DIS,
                    f"due-{i}",
                    prefill_worker="both-0",
                    decode_worker="both-1",
                    kv_due_in_s=due,
                )
                for i, (prompt, due) in enumerate(zip(prompts, [2.5, 0.0]))
            ]
        )
    finally:
        seen = ray.get(d.__ray_call__.remote(stop_recording), timeout=30)
    assert got == [hf_greedy("tiny-llama", p, MAX_NEW) for p in prompts]
    after = received(cluster)["both-1"]
    assert after[0] > before[0] and after[1:] == (before[1] + 2, before[2])  # moved, no fallback
    assert set(seen) == {"due-0", "due-1"}
    assert 2.0 < seen["due-0"] <= 2.5  # due 2.5 s after the reservation, less the call's time
    assert seen["due-1"] <= 0.0  # due at once: counted as landing from the reservation on
    assert_pools_full(cluster)
