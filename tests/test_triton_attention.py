"""The Triton paged-attention kernel against the SDPA backend, over odd shapes.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1). That variable must be set
before triton is first imported and it changes how every later `@triton.jit` kernel of the
process runs, so the interpreted checks run in one child process (started once for the module)
and this process never imports triton: on a GPU machine the same suite also runs the compiled
kernel on CUDA (tests marked gpu), which an interpreter turned on here would silently replace.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from engine.attention import AttentionMetadata, PrefillSegment, SdpaAttention
from engine.kv_cache import KVCache, KVCacheSpec

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


class Case(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    decodes: tuple[int, ...]  # context length of each decode (its new token included)
    prefills: tuple[tuple[int, int], ...]  # (tokens in the chunk, tokens cached before it)
    block_m: int = 16  # small tiles: chunks span several query tiles, contexts several key tiles
    block_n: int = 16


CASES = {
    # MQA beside decodes that end exactly on, just past and inside a block.
    "mqa_d64_mixed": Case(4, 1, 64, 16, (1, 16, 17, 40), ((5, 0), (20, 13))),
    # GQA 8/2, head_dim 128, a block size that divides nothing.
    "gqa_d128_bs5_mixed": Case(8, 2, 128, 5, (7, 3, 26), ((9, 11), (2, 0), (12, 0))),
    # MHA, head_dim 32, prefill chunks only: many segments, fresh and with cached prefixes.
    "mha_d32_many_segments": Case(
        4, 4, 32, 4, (), ((3, 0), (17, 5), (30, 0), (2, 30), (16, 16), (1, 9), (21, 43))
    ),
    # SmolLM2's grouping (9 heads over 3: a group of 3, not a power of two), decodes only.
    "gqa3_d64_bs7_decodes": Case(9, 3, 64, 7, (1, 2, 50, 7, 100, 8), ()),
    # A head_dim that is not a power of two (padded to 128 inside the kernel), prefills only.
    "gqa_d80_prefills": Case(4, 2, 80, 8, (), ((33, 0), (6, 7))),
    # Production tile sizes: one query tile per chunk, one key tile per context.
    "gqa_d64_default_tiles": Case(8, 2, 64, 16, (5, 60), ((40, 24), (11, 0)), 64, 64),
}


def build_step(case: Case, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A cache filled with noise and one step's metadata, laid out as ModelRunner lays it out:
    decodes first, then chunks, each request on its own scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    bs = case.block_size
    seqs = [(1, n - 1) for n in case.decodes] + list(case.prefills)
    needed = [-(-(start + n) // bs) for n, start in seqs]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for nb in needed:
        tables.append(perm[used : used + nb])
        used += nb
    spec = KVCacheSpec(1, case.kv_heads, case.head_dim, bs, dtype)
    cache = KVCache(spec, num_blocks, device)
    cache.layers[0].copy_(torch.randn(cache.layers[0].shape, generator=g))

    nd = len(case.decodes)
    positions = [p for n, start in seqs for p in range(start, start + n)]
    slot_blocks = [
        t[p // bs] for (n, start), t in zip(seqs, tables) for p in range(start, start + n)
    ]
    max_nb = max((len(t) for t in tables[:nd]), default=0)
    decode_table = torch.tensor(
        [t + [0] * (max_nb - len(t)) for t in tables[:nd]], dtype=torch.long
    )
    ctx = torch.tensor(case.decodes, dtype=torch.int32)
    mask = None
    if nd and min(case.decodes) != max_nb * bs:
        mask = (torch.arange(max_nb * bs)[None, :] < ctx[:, None])[:, None, None, :]
    segs, row = [], nd
    for (n, start), t in zip(seqs[nd:], tables[nd:]):
        segs.append(PrefillSegment(row, n, start, torch.tensor(t, device=device)))
        row += n
    md = AttentionMetadata(
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=torch.tensor(positions, dtype=torch.long, device=device) % bs,
        num_decodes=nd,
        decode_block_table=decode_table.view(nd, max_nb).to(device),
        decode_context_lens=ctx.to(device),
        decode_mask=None if mask is None else mask.to(device),
        prefills=tuple(segs),
    )
    T = len(positions)
    q = torch.randn(T, case.heads, case.head_dim, generator=g).to(device, dtype)
    k = torch.randn(T, case.kv_heads, case.head_dim, generator=g).to(device, dtype)
    v = torch.randn(T, case.kv_heads, case.head_dim, generator=g).to(device, dtype)
    return cache, md, q, k, v


def compare(case: Case, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(max |triton - sdpa|, max |sdpa|) for one step of `case`."""
    from engine.triton_attention import TritonPagedAttention

    cache, md, q, k, v = build_step(case, device, dtype)
    scale = case.head_dim**-0.5
    ref_backend = SdpaAttention(cache, case.heads, scale)
    ref_backend.write(0, k, v, md)
    ref = ref_backend.forward(0, q, k, v, md)
    got = TritonPagedAttention(
        cache, case.heads, scale, block_m_decode=case.block_m, block_m_prefill=case.block_m,
        block_n=case.block_n,
    ).forward(0, q, k, v, md)  # fmt: skip
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.float() - ref.float()).abs().max().item()
    return err, ref.float().abs().max().item()


def engine_greedy_check() -> bool:
    """tiny-llama end to end with the Triton backend in place of SDPA, through the metadata the
    model runner builds (chunked prefill beside decodes, prefix hits), against transformers."""
    from engine.sampling_params import SamplingParams
    from engine.triton_attention import TritonPagedAttention
    from tests.helpers import assert_pool_free, hf_greedy, make_engine, random_prompts

    engine = make_engine("tiny-llama", block_size=4, budget=16, attention_backend="sdpa")
    runner = engine.runner
    runner.attention = TritonPagedAttention(
        runner.cache, runner.model.num_heads, runner.model.scale, 16, 16, 16
    )
    prompts = random_prompts([5, 19, 30], seed=5)
    prompts.append(prompts[1][:12] + [7, 8, 9])  # shares 3 full blocks with the second prompt
    res = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    ok = all(list(r.token_ids) == hf_greedy("tiny-llama", p, 5) for p, r in zip(prompts, res))
    assert_pool_free(engine)
    return ok


def run_interpreted() -> None:
    """Child-process entry (TRITON_INTERPRET=1 already set): print every check's result."""
    torch.set_num_threads(1)
    out: dict[str, object] = {}
    for name, case in CASES.items():
        out[name] = compare(case, torch.device("cpu"), torch.float32)
    out["engine"] = engine_greedy_check()
    print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.test_triton_attention import run_interpreted; run_interpreted()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULTS ") :])


@needs_triton
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_sdpa(interpreted, name):
    err, ref_max = interpreted[name]
    assert err <= 1e-5 + 1e-4 * ref_max, f"{name}: max error {err} (reference max {ref_max})"


@needs_triton
@pytest.mark.timeout(600)
def test_interpreted_backend_in_the_engine_matches_transformers(interpreted):
    assert interpreted["engine"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_matches_sdpa(name, dtype):
    err, ref_max = compare(CASES[name], torch.device("cuda"), dtype)
    # bf16: both sides round q, k, v and the output to 8 bits of mantissa, in different orders.
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    assert err <= 1e-5 + rel * ref_max, f"{name} {dtype}: max error {err} (max {ref_max})"


@pytest.mark.gpu
def test_auto_backend_is_triton_on_cuda():
    from engine.config import CacheConfig, EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from tests.helpers import loaded

    cfg = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cuda"),
        cache=CacheConfig(block_size=16, num_blocks=16),
    )
    assert LLMEngine(cfg, loaded("tiny-llama")).runner.attention.name == "triton"
