"""Both paths with the engines and KV on one CUDA device (skipped without CUDA): two workers
share the GPU, and the default backend ("auto") settles each pair on gloo with CUDA tensors through
host memory (NCCL refuses two ranks on one device: with it every handoff failed and fell back)."""

import asyncio

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.vocab import Placement, RoutePath
from tests.helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
def test_both_paths_on_one_gpu_match_transformers():
    engine = EngineConfig(
        model=ModelConfig(device="cuda"),
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    )
    cfg = ClusterConfig(model="tiny-llama", engine=engine, gpus_per_worker=0.5)  # kv_backend auto
    c = Cluster(cfg)
    try:
        prompts = random_prompts([5, 19, 33, 70], seed=81)
        sp = SamplingParams(max_tokens=10, temperature=0.0)

        async def run(prompt, path, rid):
            placement = Placement(path=path, request_id=rid)
            return [t async for ch in c.generate(prompt, sp, placement) for t in ch.token_ids]

        async def main():
            jobs = [
                run(p, path, f"{path.value}-{i}")
                for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED)
                for i, p in enumerate(prompts)
            ]
            return await asyncio.wait_for(asyncio.gather(*jobs), 240)

        got = asyncio.run(main())
        want = [hf_greedy("tiny-llama", p, 10) for p in prompts] * 2
        assert got == want
        assert not c.fallbacks
        stats = asyncio.run(c.kv_stats())
        moved = {w: (s.bytes_sent, s.bytes_received, s.ok, s.failed) for w, s in stats.items()}
        (p,) = c.prefill_ids
        (d,) = c.decode_ids
        assert moved[p][0] > 0 and moved[d][1] > 0 and moved[d][2:] == (4, 0), moved
        for load in asyncio.run(c.load()):
            assert load.num_free_blocks == load.num_blocks and load.open_transfers == 0
    finally:
        c.shutdown()
