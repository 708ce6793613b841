"""Sampling: seeded requests are batch-invariant, filters keep the right sets, logprobs exact."""

import math
from dataclasses import replace

import pytest
import torch

from engine.sampler import sample, sample_seed
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, drain, loaded, make_engine, random_prompts

SEEDED = SamplingParams(
    max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=1234, ignore_eos=True
)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPT = random_prompts([11], seed=21)[0]


def run_alone(params: SamplingParams, name: str = "tiny-llama") -> list[int]:
    engine = make_engine(name)
    rid = engine.add_request(PROMPT, params)
    toks = drain(engine)[rid]
    assert_pool_free(engine)
    return toks


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_seeded_request_same_alone_and_in_a_changing_batch(name):
    alone = run_alone(SEEDED, name)
    engine = make_engine(name, budget=24, max_num_seqs=8)
    others = random_prompts([5, 17, 9, 30, 3], seed=22)
    other_params = [
        SamplingParams(
            max_tokens=20, temperature=0.8, top_p=0.9, top_k=40, seed=1, ignore_eos=True
        ),
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=25, temperature=1.3, seed=99, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True),  # unseeded
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    ]
    toks: dict[str, list[int]] = {}

    def step(n: int) -> None:
        for _ in range(n):
            for out in engine.step():
                toks.setdefault(out.request_id, []).extend(out.new_token_ids)

    # Neighbours join before, with and after the seeded request, so its batch keeps changing.
    engine.add_request(others[0], other_params[0])
    engine.add_request(others[1], other_params[1])
    step(2)
    rid = engine.add_request(PROMPT, SEEDED)
    engine.add_request(others[2], other_params[2])
    step(3)
    engine.add_request(others[3], other_params[3])
    step(1)
    engine.add_request(others[4], other_params[4])
    for r, t in drain(engine).items():
        toks.setdefault(r, []).extend(t)
    assert toks[rid] == alone
    assert_pool_free(engine)


def test_seeded_request_same_after_preemption():
    alone = run_alone(SEEDED)
    # 14 blocks of 4 tokens can't hold all four requests with their outputs: some are preempted
    # and recomputed, and the seeded one must still draw the same tokens.
    engine = make_engine("tiny-llama", num_blocks=14, budget=32, max_num_seqs=4)
    others = random_prompts([9, 13, 6], seed=23)
    params = [
        SamplingParams(max_tokens=16, temperature=0.9, seed=i, ignore_eos=True) for i in range(3)
    ]
    rids = [engine.add_request(p, sp) for p, sp in zip(others, params)]
    rid = engine.add_request(PROMPT, SEEDED)
    toks = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    assert toks[rid] == alone
    assert all(len(toks[r]) == 16 for r in rids)
    assert_pool_free(engine)


def test_a_seeded_request_resumed_elsewhere_goes_on_with_the_same_tokens():
    """A request resumed on another worker comes back as its prompt and the tokens it had, with
    the samples drawn for them (SamplingParams.drawn): its next tokens are those it would have
    drawn, not the seed's first ones again."""
    whole = run_alone(SEEDED)
    engine = make_engine("tiny-llama")
    rest = replace(SEEDED, max_tokens=SEEDED.max_tokens - 6, drawn=6)
    rid = engine.add_request(list(PROMPT) + whole[:6], rest)
    assert drain(engine)[rid] == whole[6:]
    assert_pool_free(engine)
    # Without it, the resumed request draws the seed's first samples again: other tokens.
    engine = make_engine("tiny-llama")
    rid = engine.add_request(list(PROMPT) + whole[:6], replace(rest, drawn=0))
    assert drain(engine)[rid] != whole[6:]


@pytest.mark.timeout(60)
def test_a_resume_after_any_number_of_samples_costs_nothing_to_take_up():
    """A seed's sample k is drawn from a generator seeded for k: a request resumed after a
    trillion samples starts at once (advancing a generator past them would take days), and
    its draws go on from there."""
    engine = make_engine("tiny-llama")
    far = replace(SEEDED, max_tokens=4, drawn=10**12)
    rid = engine.add_request(PROMPT, far)
    engine.step()
    assert engine.runner.draws[rid].drawn == 10**12 + 1
    out = drain(engine)[rid]
    assert len(out) == 3  # the first came from the step above
    assert_pool_free(engine)


def test_per_sample_seeds_draw_from_the_filtered_distribution():
    """One generator seeded afresh for each sample (sample_seed(seed, k)) draws as one
    generator running on: the frequencies are the probabilities."""
    sp = SamplingParams(temperature=1.0)
    gens = [torch.Generator().manual_seed(sample_seed(7, k)) for k in range(DRAWS)]
    tokens, _ = sample(LOGITS.expand(DRAWS, -1), [sp] * DRAWS, gens)
    counts = torch.bincount(torch.tensor(tokens), minlength=LOGITS.shape[-1])
    for i, p in enumerate(PROBS.tolist()):
        assert counts[i].item() / DRAWS == pytest.approx(p, abs=0.03)
    assert len({sample_seed(7, k) for k in range(DRAWS)}) == DRAWS
    assert sample_seed(7, 0) != sample_seed(8, 0) and 0 <= sample_seed(2**64 - 1, 5) < 2**64


def test_other_seed_gives_other_tokens():
    a = run_alone(SEEDED)
    b = run_alone(replace(SEEDED, seed=4321))
    assert len(a) == len(b) == SEEDED.max_tokens
    assert a != b


def test_top_k_one_and_min_p_near_one_equal_greedy():
    greedy = run_alone(GREEDY)
    assert run_alone(replace(SEEDED, top_k=1)) == greedy
    assert run_alone(replace(SEEDED, top_k=0, min_p=0.99)) == greedy
    # The seeded sample itself is not greedy, or the two checks above prove nothing.
    assert run_alone(SEEDED) != greedy


def test_unseeded_sampling_completes():
    params = SamplingParams(max_tokens=10, temperature=0.9, ignore_eos=True)
    engine = make_engine()
    res = engine.generate([PROMPT, PROMPT], params)
    for r in res:
        assert len(r.token_ids) == 10 and r.finish_reason.value == "length"
    assert_pool_free(engine)


def _reference_logprobs(prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' own logits at each output position."""
    model = loaded("tiny-llama").hf_model
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_chosen_and_top_alternatives(temperature):
    params = SamplingParams(
        max_tokens=8, temperature=temperature, seed=5, logprobs=3, ignore_eos=True
    )
    engine = make_engine()
    (res,) = engine.generate([PROMPT], params)
    assert len(res.logprobs) == len(res.token_ids) == 8
    ref = _reference_logprobs(PROMPT, list(res.token_ids))
    for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want_ids = torch.topk(ref[i], 3).indices.tolist()
        assert [t for t, _ in lp.top] == want_ids
        if temperature == 0.0:
            assert lp.top[0] == (tok, pytest.approx(lp.logprob))
        else:
            assert lp.logprob <= values[0] + 1e-6
    assert_pool_free(engine)


# -- the sampler's filters on hand-made logits -------------------------------------------------

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # best first: 1, 3, 2, 0
LOGITS = PROBS.log()
DRAWS = 4000


def draw_counts(sp: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits.expand(DRAWS, -1), [sp] * DRAWS, [g] * DRAWS)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1])


def kept(counts: torch.Tensor) -> set[int]:
    return {i for i, c in enumerate(counts.tolist()) if c > 0}


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.45, {1}), (0.6, {1, 3}), (0.9, {1, 3, 2}), (0.99, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    assert kept(draw_counts(SamplingParams(temperature=1.0, top_p=top_p))) == expected


@pytest.mark.parametrize(
    "top_k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (0, {0, 1, 2, 3})]
)
def test_top_k_keeps_k_best(top_k, expected):
    assert kept(draw_counts(SamplingParams(temperature=1.0, top_k=top_k))) == expected


@pytest.mark.parametrize(
    "min_p, expected", [(0.7, {1}), (0.5, {1, 3}), (0.2, {1, 2, 3}), (0.0, {0, 1, 2, 3})]
)
def test_min_p_keeps_tokens_near_the_best(min_p, expected):
    assert kept(draw_counts(SamplingParams(temperature=1.0, min_p=min_p))) == expected


def test_filtered_mass_is_renormalised():
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=2))
    # Within top-2 the odds stay 0.5 : 0.3.
    assert counts[1].item() / DRAWS == pytest.approx(0.5 / 0.8, abs=0.03)
    counts = draw_counts(SamplingParams(temperature=1.0))
    for i, p in enumerate(PROBS.tolist()):
        assert counts[i].item() / DRAWS == pytest.approx(p, abs=0.03)


def test_temperature_sharpens_and_greedy_ignores_generator():
    cold = draw_counts(SamplingParams(temperature=0.25))
    # p^(1/T) renormalised: 0.5^4 / (0.5^4 + 0.3^4 + 0.15^4 + 0.05^4)
    expect = 0.5**4 / sum(p**4 for p in PROBS.tolist())
    assert cold[1].item() / DRAWS == pytest.approx(expect, abs=0.03)
    tokens, lps = sample(LOGITS.expand(3, -1), [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert tokens == [1, 1, 1] and lps == [None] * 3


def test_sample_logprobs_are_of_the_unfiltered_distribution():
    sp = SamplingParams(temperature=0.5, top_k=1, logprobs=2)
    tokens, lps = sample(LOGITS[None], [sp], [torch.Generator().manual_seed(1)])
    (lp,) = lps
    assert tokens == [1] and lp is not None
    assert lp.logprob == pytest.approx(math.log(0.5), abs=1e-5)
    assert [t for t, _ in lp.top] == [1, 3]
    assert lp.top[1][1] == pytest.approx(math.log(0.3), abs=1e-5)


def test_unseeded_requests_sample_anew_in_each_engine_unless_it_is_given_a_seed():
    """A request without a seed draws one from its engine's source, which the OS's randomness
    seeds: two engines (two runs of `pdserve generate`, a worker and its replacement) sample
    it differently. With ModelConfig.sampling_seed they repeat."""
    prompt = random_prompts([12], seed=41)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)

    def draw(sampling_seed: int | None) -> list[int]:
        engine = make_engine("tiny-llama", sampling_seed=sampling_seed)
        engine.add_request(prompt, params, request_id="r")
        return drain(engine)["r"]

    assert draw(None) != draw(None)
    assert draw(7) == draw(7)
