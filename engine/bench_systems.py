"""The systems `pdserve bench-engine` (engine/bench_engine.py) times on the same requests, each
reported alike: output tokens per second, seconds and tokens, or the error that stopped it.

  pdserve        the engine, every request added at once and stepped until none is left, as the
                 workers run it; its step shapes are kept for the bare-forward replay
                 (engine/bare_forward.py);
  hf_sequential  transformers `generate`, one request at a time;
  hf_continuous  transformers' own continuous batching (`generate_batch`), where it exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import PagedDecoderModel
from engine.model_runner import StepShape
from engine.sampling_params import SamplingParams


def timed(fn: Callable[[], int]) -> dict[str, Any]:
    """`fn` run and timed; it returns the output tokens it made."""
    t0 = time.perf_counter()
    try:
        tokens = fn()
    except Exception as e:  # a system that can't run here is reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}
    secs = time.perf_counter() - t0
    return {"output_tok_s": tokens / secs, "seconds": secs, "output_tokens": tokens}


def run_pdserve(
    cfg: EngineConfig, loaded: Any, prompts: list[list[int]], params: SamplingParams
) -> tuple[dict[str, Any], list[StepShape], PagedDecoderModel]:
    """Time the engine on all requests at once; also return its step shapes for the replay."""
    engine = LLMEngine(cfg, loaded)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    engine.runner.trace = []

    def run_engine() -> int:
        for p in prompts:
            engine.add_request(p, params)
        n = 0
        with tqdm(total=len(prompts) * params.max_tokens, desc="pdserve", unit="tok") as bar:
            while engine.has_unfinished_requests():
                k = sum(len(o.new_token_ids) for o in engine.step())
                n += k
                bar.update(k)
        return n

    result = timed(run_engine)
    steps = engine.runner.trace
    engine.runner.trace = None
    result["steps"] = len(steps)
    result["attention_backend"] = engine.runner.attention.name
    graphs = engine.runner.graphs
    result["decode_graphs"] = graphs.sizes if graphs is not None else None
    result["graph_replays"] = sum(graphs.replays.values()) if graphs is not None else 0
    result["preemptions"] = engine.scheduler.num_preemptions
    return result, steps, engine.runner.model


def hf_sequential(model: Any, prompts: list[list[int]], n_out: int) -> int:
    """transformers `generate` on each prompt in turn; the output tokens made."""
    n = 0
    with torch.no_grad():
        for p in tqdm(prompts, desc="hf_sequential", unit="req"):
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n_out,
                min_new_tokens=n_out,
                do_sample=False,
            )
            n += out.shape[1] - len(p)
    return n


def hf_continuous(model: Any, prompts: list[list[int]], n_out: int) -> int:
    """transformers' `generate_batch` on every prompt at once; the output tokens made."""
    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers has no generate_batch")
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False)
    outs = model.generate_batch(prompts, generation_config=gc, progress_bar=True)
    return sum(len(o.generated_tokens) for o in outs.values())
