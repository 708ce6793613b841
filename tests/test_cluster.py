"""Both request paths through Ray actors on 127.0.0.1 (2 prefill x 2 decode, tiny model)."""

import asyncio
import os
import signal
import time

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.vocab import FallbackReason, Placement, RoutePath
from tests.helpers import hf_greedy, loaded, random_prompts
from worker_protocol.messages import WorkerRole

MAX_NEW = 10
COLO, DIS = RoutePath.COLOCATED, RoutePath.DISAGGREGATED
BLOCK = 4
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def cluster():
    engine = EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
    )
    cfg = ClusterConfig(
        model="tiny-llama", num_prefill=2, num_decode=2, engine=engine, kv_transfer_deadline_s=10
    )
    c = Cluster(cfg)
    yield c
    c.shutdown()


async def run_one(cluster, prompt, path, rid, **workers):
    toks, chunks = [], []
    async for chunk in cluster.generate(
        prompt, GREEDY, Placement(path=path, request_id=rid, **workers)
    ):
        toks.extend(chunk.token_ids)
        chunks.append(chunk)
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    return toks


def gather(jobs, timeout=90):
    async def main():
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout)

    return asyncio.run(main())


def received(cluster):
    stats = asyncio.run(cluster.kv_stats())
    return {w: (s.bytes_received, s.ok, s.failed) for w, s in stats.items()}


def leave_after(cluster, prompt, placement, n):
    """Stream a long greedy request and go away after `n` tokens (the client leaves); then wait,
    bounded, for the abort to reach every worker it touched and its blocks to be free."""
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        got = 0
        async for chunk in cluster.generate(prompt, params, placement):
            got += len(chunk.token_ids)
            if got >= n:
                break  # generate's cleanup aborts the request on its workers
        return got

    got = gather([main()])[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        loads = asyncio.run(cluster.load())
        if all(x.num_free_blocks == x.num_blocks and x.running == 0 for x in loads):
            break
        time.sleep(0.05)
    return got


def kv_block_bytes(model: str = "tiny-llama", block_size: int = BLOCK) -> int:
    """One block's KV bytes for `model` (keys and values of every layer, float32), from its
    config."""
    cfg = loaded(model).hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * head_dim * 4


def assert_pools_full(cluster):
    loads = asyncio.run(cluster.load(10.0))
    # Every worker answered: one that did not would pass the checks below unseen.
    assert {ld.worker_id for ld in loads} == {h.worker_id for h in cluster.pools.live()}, loads
    for load in loads:
        assert load.num_free_blocks == load.num_blocks, load
        assert load.running == load.waiting == load.waiting_for_kv == load.held == 0, load
        assert load.open_transfers == 0, load  # every transfer record released


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [COLO, DIS], ids=lambda p: p.value)
def test_paths_match_transformers_for_concurrent_requests(cluster, path):
    prompts = random_prompts([3, 9, 16, 17, 25, 33, 48, 61], seed=51)
    before = received(cluster)
    got = gather([run_one(cluster, p, path, f"{path.value}-{i}") for i, p in enumerate(prompts)])
    after = received(cluster)
    moved = sum(after[w][0] - before[w][0] for w in after)
    oks = sum(after[w][1] - before[w][1] for w in cluster.decode_ids)
    failed = sum(after[w][2] - before[w][2] for w in after)
    if path is DIS:
        # Every prompt's KV travelled: no silent fallback to recompute on the decode side.
        assert oks == len(prompts) and failed == 0 and moved > 0
    else:
        assert moved == 0
    for p, g in zip(prompts, got):
        assert g == hf_greedy("tiny-llama", p, MAX_NEW), f"{path.value}: prompt of {len(p)} tokens"
    assert_pools_full(cluster)


@pytest.mark.timeout(120)
def test_all_four_pairings_concurrently(cluster):
    prompts = random_prompts([7, 21, 30, 12, 44, 5, 26, 39], seed=52)
    pairs = [(p, d) for p in cluster.prefill_ids for d in cluster.decode_ids]
    jobs = [
        run_one(
            cluster,
            prompt,
            DIS,
            f"pair-{i}",
            prefill_worker=pairs[i % 4][0],
            decode_worker=pairs[i % 4][1],
        )
        for i, prompt in enumerate(prompts)
    ]
    before = received(cluster)
    got = gather(jobs)
    after = received(cluster)
    assert not cluster.fallbacks
    for p, g in zip(prompts, got):
        assert g == hf_greedy("tiny-llama", p, MAX_NEW)
    # Each decode worker received the KV of its 4 requests, none failed (no silent recompute).
    for d in cluster.decode_ids:
        assert after[d][1] - before[d][1] == 4 and after[d][2] == before[d][2]
    assert_pools_full(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [COLO, DIS], ids=lambda p: p.value)
def test_client_leaving_mid_stream_frees_everything(cluster, path):
    assert leave_after(cluster, random_prompts([30], seed=60)[0], Placement(path=path), 3) >= 3
    assert_pools_full(cluster)


@pytest.mark.timeout(120)
def test_prefix_cached_on_decode_worker_is_not_sent_again(cluster):
    block_bytes = kv_block_bytes()
    base = random_prompts([24], seed=53)[0]
    longer = base + random_prompts([10], seed=54)[0]  # 34 tokens: 9 blocks, the first 6 cached
    where = {"prefill_worker": "prefill-0", "decode_worker": "decode-1"}
    gather([run_one(cluster, base, COLO, "warm", decode_worker="decode-1")])
    before = received(cluster)["decode-1"][0]
    (got,) = gather([run_one(cluster, longer, DIS, "after-warm", **where)])
    assert received(cluster)["decode-1"][0] - before == 3 * block_bytes
    assert got == hf_greedy("tiny-llama", longer, MAX_NEW)
    assert_pools_full(cluster)


@pytest.mark.timeout(120)
def test_a_prefill_worker_killed_by_pid_is_replaced_and_the_replacement_takes_requests():
    engine = EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )
    c = Cluster(ClusterConfig(model="tiny-llama", engine=engine, kv_transfer_deadline_s=5))
    try:
        prompts = random_prompts([19, 40, 27], seed=55)
        (first,) = gather([run_one(c, prompts[0], DIS, "before-kill")])
        assert first == hf_greedy("tiny-llama", prompts[0], MAX_NEW)
        old = c.worker_info("prefill-0")
        assert old.incarnation == 0 and old.pid > 0
        os.kill(old.pid, signal.SIGKILL)
        # The request reaches the dead actor: decode-0 recomputes it, and the death is noticed.
        (second,) = gather([run_one(c, prompts[1], DIS, "after-kill")], timeout=60)
        assert second == hf_greedy("tiny-llama", prompts[1], MAX_NEW)
        assert c.dead == ["prefill-0"]
        assert [(rid, why) for rid, why, _ in c.fallbacks] == [
            ("after-kill", FallbackReason.PREFILL_FAILED)
        ]
        # A new actor under the same id: up, paired with decode-0 and warm before it takes load.
        deadline = time.monotonic() + 60
        while c.prefill_ids != ["prefill-0"]:
            assert time.monotonic() < deadline, "prefill-0 was not replaced within 60 s"
            time.sleep(0.1)
        new = c.worker_info("prefill-0")
        assert new.incarnation == 1 and new.pid != old.pid
        # What it reports counts serving only: its warm-up is no busy time, lookup or step.
        (ld,) = [ld for ld in asyncio.run(c.load()) if ld.worker_id == "prefill-0"]
        assert (ld.busy_s, ld.prefix_queries, ld.prefix_hits, ld.preemptions) == (0, 0, 0, 0)
        assert c.pools.pairs.connected("prefill-0", "decode-0")
        assert c.pools.restarts[WorkerRole.PREFILL] == 1
        before = received(c)
        (third,) = gather([run_one(c, prompts[2], DIS, "after-replace")])
        assert third == hf_greedy("tiny-llama", prompts[2], MAX_NEW)
        after = received(c)
        assert after["decode-0"][1] - before["decode-0"][1] == 1  # its KV came from the new one
        sent = asyncio.run(c.kv_stats())["prefill-0"]
        assert sent.bytes_sent > 0 and sent.ok == 1 and len(c.fallbacks) == 1
        assert_pools_full(c)
    finally:
        c.shutdown()


@pytest.mark.timeout(120)
def test_logprobs_reach_the_client_on_both_paths(cluster):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    prompt = random_prompts([14], seed=56)[0]

    async def collect(path):
        toks, lps = [], []
        async for chunk in cluster.generate(prompt, params, Placement(path=path)):
            toks.extend(chunk.token_ids)
            lps.extend(chunk.logprobs)
        return toks, lps

    before, fell = received(cluster), list(cluster.fallbacks)
    (co_toks, co_lps), (dis_toks, dis_lps) = gather([collect(COLO), collect(DIS)])
    after = received(cluster)
    # The disaggregated one's KV travelled (one transfer completed, bytes moved, none failed)
    # and it did not fall back to a local prefill.
    assert sum(after[w][1] - before[w][1] for w in cluster.decode_ids) == 1
    assert sum(after[w][0] - before[w][0] for w in after) > 0
    assert sum(after[w][2] - before[w][2] for w in after) == 0
    assert list(cluster.fallbacks) == fell
    assert co_toks == dis_toks and len(dis_lps) == len(dis_toks) == 6
    for a, b in zip(co_lps, dis_lps):
        assert a.token_id == b.token_id and len(b.top) == 2
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert_pools_full(cluster)


@pytest.mark.timeout(120)
def test_a_worker_running_other_code_refuses_itself_before_its_model_loads(cluster):
    """The router hands its code to each worker it starts: one that runs other code fails its
    start at once (its constructor's first step, before the engine), and the router reads why
    from Ray's error."""
    import ray

    from decode_worker.worker import DecodeWorker
    from worker_protocol.code_id import code_id, other_code, refused_at_start

    actor = (
        ray.remote(DecodeWorker)
        .options(num_cpus=0)
        .remote("decode-other", cluster.pools.config.spec, 0, router_code="0123456789abcdef")
    )
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(actor.ready.remote(), timeout=60)
    error = str(info.value)
    assert f"pdserve worker code {code_id()} is not the router's (0123456789abcdef)" in error
    assert "LLMEngine" not in error, error  # it struck before the engine was built
    assert refused_at_start(error) == other_code(code_id())


def test_a_prefill_worker_answers_a_request_of_one_token_and_refuses_a_longer_one(cluster):
    """Placed colocated on a prefill worker, a request of one token is answered there (the
    greedy token transformers gives, its blocks freed); one of two tokens is refused there,
    naming the worker and its max_tokens, and leaves nothing behind."""
    import ray

    [prompt] = random_prompts([21], seed=917)
    at = Placement(path=RoutePath.COLOCATED, request_id="one", decode_worker="prefill-1")

    async def tokens(params: SamplingParams, placement: Placement) -> list[int]:
        return [t async for c in cluster.generate(prompt, params, placement) for t in c.token_ids]

    one = SamplingParams(max_tokens=1, temperature=0.0)
    assert gather([tokens(one, at)]) == [hf_greedy("tiny-llama", prompt, 1)]
    two = SamplingParams(max_tokens=2, temperature=0.0)
    at2 = Placement(path=RoutePath.COLOCATED, request_id="two", decode_worker="prefill-1")
    with pytest.raises(ray.exceptions.RayTaskError, match="prefill-1 is a prefill worker.*not 2"):
        gather([tokens(two, at2)])
    assert_pools_full(cluster)
