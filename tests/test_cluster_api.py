"""The Cluster's Python API as a caller uses it (README, "A local cluster"): a request the
engine refuses on the disaggregated path fails at once with the engine's error (no fallback),
a consumer failing in its loop under aclosing leaves no block held, and a shut-down cluster
says so. One prefill and one decode worker on 127.0.0.1, tiny model."""

import asyncio
import contextlib

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.core_types import NoWorkers
from router.vocab import Placement, RoutePath
from tests.helpers import random_prompts
from tests.test_cluster import assert_pools_full

ENGINE = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=256))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(ClusterConfig(model="tiny-llama", num_prefill=1, num_decode=1, engine=ENGINE))
    yield c
    c.shutdown()


async def _collect(cluster, prompt, placement, params=GREEDY):
    async with contextlib.aclosing(cluster.generate(prompt, params, placement)) as chunks:
        return [t async for chunk in chunks for t in chunk.token_ids]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["empty", "token_id", "whole_context"])
def test_a_request_the_engine_refuses_fails_on_the_disaggregated_path_without_a_fallback(
    cluster, what
):
    """Its decode worker's reserve refuses it: the request's own fault, which the decode worker
    prefilling it would refuse again. It fails with that error, not as a handoff fallback."""
    info = cluster.worker_info(cluster.decode_ids[0])
    prompt = {
        "empty": [],
        "token_id": [1, 2, info.vocab_size + 5],
        "whole_context": random_prompts([info.max_model_len], seed=3)[0],
    }[what]
    counts, latest = dict(cluster.handoffs.fallback_counts), list(cluster.fallbacks)
    placement = Placement(path=RoutePath.DISAGGREGATED)
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(asyncio.wait_for(_collect(cluster, prompt, placement), 60))
    assert caught.value.field in ("prompt", "prompt_token_ids"), caught.value
    assert cluster.handoffs.fallback_counts == counts
    assert list(cluster.fallbacks) == latest
    assert_pools_full(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [RoutePath.COLOCATED, RoutePath.DISAGGREGATED], ids=str)
def test_a_consumer_failing_in_its_loop_leaves_no_block_held(cluster, path):
    """The error is kept (its traceback holds the consumer's frame, and so the generator, as a
    logger or pytest.raises would): under aclosing the request is aborted on its workers when
    the loop ends, not when the generator is collected, and a long request would run on."""
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    prompt = random_prompts([30], seed=60)[0]

    async def consume():
        chunks = cluster.generate(prompt, params, Placement(path=path))
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.token_ids:
                    raise ValueError("the consumer fails")

    with pytest.raises(ValueError, match="the consumer fails"):
        asyncio.run(asyncio.wait_for(consume(), 60))
    assert_pools_full(cluster)  # at once: the abort was awaited as the loop ended


@pytest.mark.timeout(120)
def test_prompt_logprobs_come_from_the_colocated_path_and_are_refused_on_a_handoff(cluster):
    """Colocated, the first chunk brings the prompt's logprobs; a handoff (whose decode worker
    computes no prompt) refuses them before any work, rather than leave them out."""
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    prompt = random_prompts([12], seed=61)[0]

    async def first_prompt_logprobs(path):
        chunks = cluster.generate(prompt, params, Placement(path=path))
        async with contextlib.aclosing(chunks):
            return [c.prompt_logprobs async for c in chunks]

    got = asyncio.run(asyncio.wait_for(first_prompt_logprobs(RoutePath.COLOCATED), 60))
    assert [len(lps) for lps in got if lps] == [len(prompt) - 1]
    assert [lp.token_id for lp in next(lps for lps in got if lps)] == prompt[1:]
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(asyncio.wait_for(first_prompt_logprobs(RoutePath.DISAGGREGATED), 60))
    assert caught.value.field == "prompt_logprobs"
    assert_pools_full(cluster)


def test_placement_takes_a_path_by_its_name():
    assert Placement(path="colocated").path is RoutePath.COLOCATED  # type: ignore[arg-type]
    assert Placement(path="disaggregated").path is RoutePath.DISAGGREGATED  # type: ignore[arg-type]
    for bad in ("auto", RoutePath.AUTO, "remote", None):
        with pytest.raises(ValueError, match="'colocated' or 'disaggregated'"):
            Placement(path=bad)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_a_request_after_shutdown_is_refused_naming_the_shutdown():
    c = Cluster(ClusterConfig(model="tiny-llama", num_prefill=0, num_decode=1, engine=ENGINE))
    prompt = random_prompts([5], seed=1)[0]
    try:
        assert asyncio.run(_collect(c, prompt, Placement(path=RoutePath.COLOCATED)))
        assert_pools_full(c)  # the request before the shutdown left nothing held
    finally:
        c.shutdown()
    for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED):
        with pytest.raises(NoWorkers, match="the cluster is shut down"):
            asyncio.run(_collect(c, prompt, Placement(path=path)))
