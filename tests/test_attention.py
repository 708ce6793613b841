"""The compiled paged-decode kernel against the portable SDPA backend, and the engine on each."""

import subprocess
import sys

import pytest
import torch

from engine import paged_attention_cpu
from engine.attention import AttentionMetadata, SdpaAttention
from engine.kv_cache import KVCache, KVCacheSpec
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, hf_greedy, make_engine, random_prompts


def decode_metadata(lens: list[int], bs: int, num_blocks: int, g: torch.Generator):
    max_nb = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks, generator=g)[: len(lens) * max_nb]
    table = perm.view(len(lens), max_nb)
    ctx = torch.tensor(lens, dtype=torch.int32)
    mask = (torch.arange(max_nb * bs)[None, :] < ctx[:, None])[:, None, None, :]
    return AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_block_table=table,
        decode_context_lens=ctx,
        decode_mask=mask,
        prefills=(),
    )


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_paged_kernel_matches_sdpa(heads, kv_heads):
    lib = paged_attention_cpu.load_kernel()
    assert lib is not None, "the C kernel must build on this machine (gcc is part of the setup)"
    g = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(1, kv_heads, 32, 16, torch.float32)
    cache = KVCache(spec, 200, torch.device("cpu"))
    cache.layers[0].normal_(generator=g)
    lens = [1, 15, 16, 17, 100, 333, 64]
    md = decode_metadata(lens, 16, 200, g)
    q = torch.randn(len(lens), heads, 32, generator=g)
    scale = 32**-0.5
    ref = SdpaAttention(cache, heads, scale).decode(0, q, md)
    got = paged_attention_cpu.PagedCpuAttention(cache, heads, scale, lib).decode(0, q, md)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_auto_backend_is_the_kernel_on_cpu_float32():
    engine = make_engine("tiny-llama")
    assert engine.runner.attention.name == "paged-cpu"


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_sdpa_backend_matches_transformers(arch):
    engine = make_engine(arch, num_blocks=24, budget=12, attention_backend="sdpa")
    assert engine.runner.attention.name == "sdpa"
    prompts = random_prompts([5, 19, 33, 48], seed=5)
    res = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for p, r in zip(prompts, res):
        assert list(r.token_ids) == hf_greedy(arch, p, 10)
    assert_pool_free(engine)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend"):
        make_engine("tiny-llama", attention_backend="flash")


CHECK_SUBNORMALS = """
import torch
from engine import paged_attention_cpu
assert paged_attention_cpu.load_kernel() is not None
print(float(torch.tensor(torch.finfo(torch.float32).tiny) / 2) > 0)
"""


def test_loading_the_kernel_keeps_subnormal_floats():
    """The kernel library must not turn on flush-to-zero in the thread that loads it (as a
    library linked with -ffast-math does): torch's float ops there would lose subnormals."""
    out = subprocess.run(
        [sys.executable, "-c", CHECK_SUBNORMALS], capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip() == "True", out.stderr[-2000:]
