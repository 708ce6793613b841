"""Repetition, presence and frequency penalties: transformers' repetition rule, OpenAI's
presence and frequency rule over the output only, the same tokens in any batch and after a
resume elsewhere."""

from array import array
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.errors import InvalidRequestError
from engine.penalties import Seen, penalize_
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, drain, make_engine, random_prompts

PROMPT = random_prompts([11], seed=21)[0]
# Strong enough to change a tiny model's greedy output within a few tokens.
PENALIZED = SamplingParams(
    max_tokens=16, temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0, ignore_eos=True
)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers_rule(penalty):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=g)
    seen = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (7, 1, 20)]
    want = torch.cat([
        RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([s]), logits[i : i + 1].clone())
        for i, s in enumerate(seen)
    ])  # fmt: skip
    sp = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    rows = [(i, sp, Seen(array("q", s), len(s), len(s))) for i, s in enumerate(seen)]
    penalize_(logits, rows)
    assert torch.equal(logits, want)


def test_presence_and_frequency_count_the_output_only():
    logits = torch.zeros(2, 6)
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # prompt 1 1 2, output 2 3 3 3: token 1 untouched, 2 once, 3 three times; row 1 untouched.
    penalize_(logits, [(0, sp, Seen(array("q", [1, 1, 2, 2, 3, 3, 3, 4]), 7, 3))])  # 4: unseen
    assert logits[0].tolist() == [0.0, 0.0, -0.75, -1.25, 0.0, 0.0]
    assert logits[1].tolist() == [0.0] * 6


def test_penalties_change_greedy_rows_and_logprobs_are_the_models():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    sp = SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=1)
    tokens, lps = sample(logits, [sp], [None], [Seen(array("q", [3, 1]), 2, 1)])
    assert tokens == [2]  # token 1 was in the output: 3.0 - 1.0 < 2.9
    (lp,) = lps
    assert lp is not None and lp.top[0][0] == 1  # the model's own best, before penalties
    assert sample(logits, [sp], [None])[0] == [1]  # nothing seen: nothing penalized


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("frequency_penalty", float("nan")),
     ("repetition_penalty", 0.0), ("repetition_penalty", float("inf"))],
)  # fmt: skip
def test_out_of_range_penalties_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def run(prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine("tiny-llama")
    rid = engine.add_request(prompt, params)
    toks = drain(engine)[rid]
    assert_pool_free(engine)
    return toks


def test_a_penalized_request_is_the_same_in_a_changing_batch():
    alone = run(PROMPT, PENALIZED)
    assert alone != run(PROMPT, replace(PENALIZED, presence_penalty=0, frequency_penalty=0))
    engine = make_engine("tiny-llama", budget=24, max_num_seqs=8)
    others = random_prompts([5, 17, 9, 30], seed=22)
    other_params = [
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.4, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=25, temperature=1.0, seed=9, frequency_penalty=2.0),
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=-1.0, ignore_eos=True),
    ]
    for p, sp in zip(others[:2], other_params[:2]):
        engine.add_request(p, sp)
    engine.step()
    rid = engine.add_request(PROMPT, PENALIZED)
    first = [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    for p, sp in zip(others[2:], other_params[2:]):
        engine.add_request(p, sp)
    assert first + drain(engine)[rid] == alone
    assert_pool_free(engine)


def test_a_penalized_request_resumed_elsewhere_counts_its_earlier_output():
    """Resumed on another worker, a request comes back as its prompt and the tokens it had, with
    `drawn` counting them: they are output, which presence and frequency penalize."""
    whole = run(PROMPT, PENALIZED)
    rest = replace(PENALIZED, max_tokens=PENALIZED.max_tokens - 6, drawn=6)
    assert run(list(PROMPT) + whole[:6], rest) == whole[6:]
    # Taken as prompt, they would not be penalized: other tokens.
    assert run(list(PROMPT) + whole[:6], replace(rest, drawn=0)) != whole[6:]


@pytest.mark.parametrize(
    "bias",
    [((1, 101.0),), ((1, float("nan")),), ((-1, 1.0),), ((1, 1.0), (1, 2.0)), ((True, 1.0),),
     ((1, "1"),), ((1,),), tuple((t, 1.0) for t in range(301))],
)  # fmt: skip
def test_bad_logit_biases_are_refused_naming_the_field(bias):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.field == "logit_bias"


def test_logit_bias_is_added_after_penalties_and_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    sp = SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias={3: 1.5}, logprobs=1)
    assert sp.logit_bias == ((3, 1.5),)  # a dict is taken as its pairs
    assert SamplingParams(logit_bias={9: 1, 2: -1}).logit_bias == ((2, -1), (9, 1))  # sorted
    assert sp.penalized and not replace(sp, presence_penalty=0.0).penalized
    tokens, lps = sample(logits, [sp], [None], [Seen(array("q", [1]), 1, 0)])
    assert tokens == [2] and lps[0] is not None and lps[0].top[0][0] == 1
    tokens, _ = sample(logits, [replace(sp, presence_penalty=0.0, logit_bias=((3, 2.5),))], [None])
    assert tokens == [3]  # 1.0 + 2.5 > 3.0, with no penalized row at all


def test_an_engine_refuses_a_logit_bias_outside_its_vocabulary():
    engine = make_engine("tiny-llama")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(PROMPT, SamplingParams(logit_bias=((1 << 20, 1.0),)))
    assert err.value.field == "logit_bias" and "outside" in str(err.value)
