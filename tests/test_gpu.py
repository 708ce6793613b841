"""The engine on CUDA: same token-for-token contract as on CPU. Skipped without a CUDA device."""

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, loaded, random_prompts

pytestmark = pytest.mark.gpu


def cuda_engine(name: str, dtype: str = "float32", eager: bool = False) -> LLMEngine:
    cfg = EngineConfig(
        model=ModelConfig(model=name, device="cuda", dtype=dtype, enforce_eager=eager),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(48, 8, True),
    )
    return LLMEngine(cfg, loaded(name))


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_cuda_greedy_matches_transformers_on_cuda(arch):
    engine = cuda_engine(arch)
    model = loaded(arch).hf_model.to("cuda")
    try:
        prompts = random_prompts([5, 17, 40, 90], seed=2)
        res = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
        for p, r in zip(prompts, res):
            ids = torch.tensor([p], device="cuda")
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )[0, len(p) :].tolist()
            assert list(r.token_ids) == ref
        assert engine.runner.cache.layers[0].device.type == "cuda"
        assert_pool_free(engine)
    finally:
        model.to("cpu")


def test_cuda_seeded_sampling_is_batch_invariant():
    engine = cuda_engine("tiny-llama")
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    (alone,) = engine.generate(random_prompts([12], seed=1), sp)
    others = random_prompts([30, 4, 60], seed=3)
    mixed = engine.generate(
        random_prompts([12], seed=1) + others,
        [sp] + [SamplingParams(max_tokens=16, seed=i) for i in range(3)],
    )
    assert mixed[0].token_ids == alone.token_ids
    assert_pool_free(engine)


def test_cuda_decode_graphs_replay_the_eager_tokens():
    """Decode steps replay captured graphs (padded batches included) and give the tokens the
    same engine gives with --enforce-eager, in float32 (bf16 with graphs: tests/test_dtype.py,
    against transformers within its tolerance)."""
    graphed, eager = cuda_engine("tiny-llama"), cuda_engine("tiny-llama", eager=True)
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.captures == 1 and eager.runner.graphs is None
    prompts = random_prompts([5, 17, 40, 90, 3, 11, 29], seed=4)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0) for i in range(7)]
    got = graphed.generate(prompts, params)
    want = eager.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert graphs.replays[8] > 0 and graphs.replays[1] > 0, graphs.replays
    assert_pool_free(graphed)
