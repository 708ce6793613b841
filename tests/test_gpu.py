"""The engine on CUDA: same token-for-token contract as on CPU. Skipped without a CUDA device."""

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, loaded, random_prompts

pytestmark = pytest.mark.gpu


def cuda_engine(name: str, dtype: str = "float32") -> LLMEngine:
    cfg = EngineConfig(
        model=ModelConfig(model=name, device="cuda", dtype=dtype),
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
