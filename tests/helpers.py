"""Shared test helpers: tiny engines and transformers' own greedy reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.tiny_models import build_tiny_model

_LOADED: dict[str, LoadedModel] = {}


def loaded(name: str) -> LoadedModel:
    if name not in _LOADED:
        _LOADED[name] = load_model(ModelConfig(model=name))
    return _LOADED[name]


def make_engine(
    name: str = "tiny-llama",
    block_size: int = 4,
    num_blocks: int = 256,
    budget: int = 64,
    max_num_seqs: int = 16,
    chunked: bool = True,
    caching: bool = True,
    attention_backend: str = "auto",
    step_target_s: float | None = None,
    detokenize: bool = True,
    prefill_hold_s: float | None = None,
    sampling_seed: int | None = None,
) -> LLMEngine:
    cfg = EngineConfig(
        model=ModelConfig(
            model=name, attention_backend=attention_backend, sampling_seed=sampling_seed
        ),
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching
        ),
        scheduler=SchedulerConfig(
            budget,
            min(max_num_seqs, budget),
            chunked,
            step_target_s=step_target_s,
            prefill_hold_s=prefill_hold_s,
        ),
        detokenize=detokenize,
    )
    return LLMEngine(cfg, loaded(name))


def hf_greedy(name: str, prompt: list[int], max_new_tokens: int, **generate: Any) -> list[int]:
    """transformers' own greedy generation; stops at EOS like the engine does. `generate`: more
    of generate's arguments (repetition_penalty)."""
    model = loaded(name).hf_model
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **generate,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle (bounded); return each request's output tokens."""
    toks: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return toks
        for out in engine.step():
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def assert_pool_free(engine: LLMEngine) -> None:
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.all_free(), "blocks still held after every request ended"


def save_gpt2_with_tokenizer(folder: Path) -> None:
    """A model folder of an architecture pdserve does not run (GPT-2), with a tokenizer beside
    it: readable by transformers, refused by pdserve's loader."""
    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(folder)
    build_tiny_model("tiny-llama")[1].save_pretrained(folder)
