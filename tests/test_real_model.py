"""The default model end to end through the engine: the one real-model test of the engine."""

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.errors import ModelNotFoundError
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    try:
        loaded = load_model(ModelConfig())
    except ModelNotFoundError as exc:  # the package is part of the test install
        pytest.fail(str(exc))
    cfg = EngineConfig(model=ModelConfig(), cache=CacheConfig(block_size=16, num_blocks=64))
    return LLMEngine(cfg, loaded)


def test_default_model_answers_paris_token_for_token(engine):
    ids = engine.encode("What is the capital of France?", chat=True)
    (out,) = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.text
    with torch.no_grad():
        ref = engine.loaded.hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
        )[0, len(ids) :].tolist()
    assert list(out.token_ids) == ref
    assert engine.kv.pool.all_free()
