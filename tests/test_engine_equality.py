"""Greedy outputs equal transformers' own generate, token for token, on every scheduling path."""

import pytest

from engine.config import MIN_CHUNK
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, hf_greedy, make_engine, random_prompts

ARCHS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]
LENGTHS = [3, 6, 9, 14, 21, 30, 43, 57]
MAX_NEW = 12


def shared_prefix_prompts() -> list[list[int]]:
    prompts = random_prompts(LENGTHS, seed=7)
    # Two prompts reuse another's first 12 and 20 tokens, so the prefix cache gets hits.
    prompts.append(prompts[5][:20] + random_prompts([9], seed=8)[0])
    prompts.append(prompts[6][:12] + random_prompts([5], seed=9)[0])
    return prompts


def run_staggered(engine, prompts, params, cached=None):
    """Add prompts a few at a time between steps, then drain. `cached` gets each request's
    prefix-cache hit in tokens, in prompt order."""
    rids = []
    toks: dict[str, list[int]] = {}
    hits: dict[str, int] = {}

    def take(outs):
        for out in outs:
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
            hits[out.request_id] = out.num_cached_tokens

    for i, p in enumerate(prompts):
        rids.append(engine.add_request(p, params))
        if i % 3 == 2:
            for _ in range(2):
                take(engine.step())
    while engine.has_unfinished_requests():
        take(engine.step())
    if cached is not None:
        cached.extend(hits[r] for r in rids)
    return [toks[r] for r in rids]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_chunked_with_prefix_hits(arch):
    # block 4, budget 10: chunks end mid-block; shared prefixes give cache hits.
    engine = make_engine(arch, block_size=4, budget=10, max_num_seqs=6)
    prompts = shared_prefix_prompts()
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    cached: list[int] = []
    got = run_staggered(engine, prompts, params, cached)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(arch, p, MAX_NEW), f"prompt of {len(p)} tokens"
    # The two prompts that reuse a prefix skipped its full blocks (20 -> 20, 12 -> 12 tokens).
    assert cached[-2:] == [20, 12]
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_under_preemption(arch):
    # 20 blocks of 4 tokens cannot hold all prompts and their outputs at once.
    engine = make_engine(arch, block_size=4, num_blocks=20, budget=32, max_num_seqs=8)
    prompts = random_prompts(LENGTHS, seed=11)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    got = run_staggered(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for p, g in zip(prompts, got):
        assert g == hf_greedy(arch, p, MAX_NEW), f"prompt of {len(p)} tokens"
    assert_pool_free(engine)


def test_greedy_matches_transformers_with_chunks_sized_to_a_step_target():
    # A target no step can meet: every prefill next to a decode goes in the smallest chunks.
    engine = make_engine("tiny-llama", block_size=4, budget=64, step_target_s=1e-6)
    prompts = random_prompts([5, 90, 11, 70], seed=8)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    got = run_staggered(engine, prompts, params)
    for p, g in zip(prompts, got):
        assert g == hf_greedy("tiny-llama", p, MAX_NEW)
    assert engine.scheduler.sizer is not None and engine.scheduler.sizer.chunk == MIN_CHUNK
    assert_pool_free(engine)


def test_greedy_matches_transformers_with_prompts_waiting_for_decodes():
    # A target no step can meet and a long hold: prompts wait for the running decodes to end,
    # then run at the whole budget.
    engine = make_engine("tiny-llama", block_size=4, budget=64, step_target_s=1e-6,
                         prefill_hold_s=60.0)  # fmt: skip
    prompts = random_prompts([5, 9, 200, 150, 120, 8], seed=11)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    got = run_staggered(engine, prompts, params)
    for p, g in zip(prompts, got):
        assert g == hf_greedy("tiny-llama", p, MAX_NEW)
    sizer = engine.scheduler.sizer
    assert sizer is not None and not sizer.fits() and engine.scheduler.num_held_steps > 0
    assert_pool_free(engine)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_greedy_matches_transformers_with_prompts_completing_alone(arch):
    """On a compute-bound host a step of prompts alone that completes one takes no tokens of the
    next (engine/prompt_steps.py; the cap is set here, as a tiny model's steps never ask for
    it): one prompt completes per step until decodes run beside them."""
    engine = make_engine(arch, block_size=4, budget=64, max_num_seqs=8)
    steps = engine.scheduler.prompt_steps
    steps.observe = lambda *args: None  # type: ignore[method-assign]
    steps.fixed_tokens = 0.0
    prompts = random_prompts(LENGTHS, seed=17)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    rids = [engine.add_request(p, params) for p in prompts]
    first = engine.step()
    assert [out.request_id for out in first] == rids[:1]  # 3 tokens, then nothing of the next
    toks = {out.request_id: list(out.new_token_ids) for out in first}
    while engine.has_unfinished_requests():
        for out in engine.step():
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
    for p, rid in zip(prompts, rids):
        assert toks[rid] == hf_greedy(arch, p, MAX_NEW), f"prompt of {len(p)} tokens"
    assert_pool_free(engine)


@pytest.mark.parametrize(("arch", "penalty"), [("tiny-llama", 1.5), ("tiny-qwen2", 0.6)])
def test_repetition_penalty_matches_transformers_chunked_and_preempted(arch, penalty):
    """Greedy with a repetition penalty (above 1 against repeats, below 1 for them) equals
    transformers' generate with the same penalty, through chunks, prefix hits and preemption."""
    engine = make_engine(arch, block_size=4, num_blocks=24, budget=10, max_num_seqs=8)
    prompts = shared_prefix_prompts()
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=penalty)
    got = run_staggered(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    plain = 0
    for p, g in zip(prompts, got):
        assert g == hf_greedy(arch, p, MAX_NEW, repetition_penalty=penalty), f"{len(p)} tokens"
        plain += g == hf_greedy(arch, p, MAX_NEW)
    assert plain < len(prompts) // 2  # the penalty changed most outputs
    assert_pool_free(engine)


def test_logit_bias_matches_transformers_sequence_bias():
    """Greedy with logit biases (one all but banning a token, one raising another) equals
    transformers' generate with the same biases as one-token sequence biases."""
    engine = make_engine("tiny-llama", block_size=4, budget=10, max_num_seqs=8)
    prompts = shared_prefix_prompts()
    bias = ((3, -100.0), (7, 4.0), (184, 2.5))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias=bias)
    got = run_staggered(engine, prompts, params)
    hf_bias = [[[t], b] for t, b in bias]
    plain = 0
    for p, g in zip(prompts, got):
        assert g == hf_greedy("tiny-llama", p, MAX_NEW, sequence_bias=hf_bias), f"{len(p)} tokens"
        assert 3 not in g
        plain += g == hf_greedy("tiny-llama", p, MAX_NEW)
    assert plain < len(prompts) // 2  # the biases changed most outputs
    assert_pool_free(engine)


def test_greedy_matches_transformers_unchunked():
    engine = make_engine("tiny-llama", block_size=8, budget=16, chunked=False)
    prompts = random_prompts([5, 40, 11], seed=3)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    got = run_staggered(engine, prompts, params)
    for p, g in zip(prompts, got):
        assert g == hf_greedy("tiny-llama", p, MAX_NEW)
    assert_pool_free(engine)


def test_generate_offline_api_and_text():
    engine = make_engine("tiny-llama")
    res = engine.generate(
        ["hello world", "héllo wörld ✓"], SamplingParams(max_tokens=8, temperature=0)
    )
    assert len(res) == 2
    for r in res:
        assert 1 <= len(r.token_ids) <= 8
        assert r.text == engine.tokenizer.decode(list(r.token_ids), skip_special_tokens=True)
    assert_pool_free(engine)
