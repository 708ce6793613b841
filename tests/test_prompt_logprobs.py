"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the tokens
before it, and the top alternatives, equal to transformers' own logits, given with the first
output; computed over chunks, beside other requests, after a preemption, and never taken from
the prefix cache. The tokens generated are greedy's either way."""

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, drain, hf_greedy, loaded, make_engine, random_prompts

MODEL = "tiny-llama"
NEW = 6
ASK = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
PLAIN = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def reference_logprobs(prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at prompt positions 0 .. len - 2."""
    with torch.no_grad():
        logits = loaded(MODEL).hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check_prompt_logprobs(prompt: list[int], lps, k: int = 3) -> None:
    """`lps` (engine TokenLogprobs or their wire form) are `prompt`'s as transformers gives them:
    one per token after the first, with its top `k`."""
    ref = reference_logprobs(prompt)
    assert len(lps) == len(prompt) - 1
    for p, lp in enumerate(lps):
        top = [(t.token_id, t.logprob) for t in lp.top] if hasattr(lp, "ListFields") else lp.top
        assert lp.token_id == prompt[p + 1]
        assert lp.logprob == pytest.approx(float(ref[p, prompt[p + 1]]), abs=1e-4)
        assert [t for t, _ in top] == torch.topk(ref[p], k).indices.tolist()
        assert [v for _, v in top] == pytest.approx(torch.topk(ref[p], k).values.tolist(), abs=1e-4)


def test_prompt_logprobs_over_chunks_beside_other_requests_equal_transformers():
    engine = make_engine(MODEL, budget=16)  # a 45-token prompt takes three steps or more
    long, short, other = random_prompts([45, 7, 20], seed=31)
    rids = [
        engine.add_request(long, ASK),
        engine.add_request(short, ASK),
        engine.add_request(other, PLAIN),
    ]
    firsts: dict[str, tuple] = {}
    later: list = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in firsts:
                firsts[out.request_id] = out.prompt_logprobs
                held = engine.scheduler.requests[out.request_id].prompt_logprobs
                assert held == [], "given, they are let go (a long prompt's would be held)"
            else:
                later.append(out.prompt_logprobs)
    check_prompt_logprobs(long, firsts[rids[0]])
    check_prompt_logprobs(short, firsts[rids[1]])
    assert firsts[rids[2]] == ()  # not asked for
    assert not any(later)  # with the first output only
    assert_pool_free(engine)


def test_the_tokens_are_greedy_s_and_offline_generate_gives_them():
    (prompt,) = random_prompts([23], seed=32)
    engine = make_engine(MODEL, budget=8)
    (res,) = engine.generate([prompt], ASK)
    assert list(res.token_ids) == hf_greedy(MODEL, prompt, NEW)
    check_prompt_logprobs(prompt, res.prompt_logprobs)
    assert_pool_free(engine)


def test_a_cached_prompt_is_computed_again_for_its_logprobs():
    """The second of two equal prompts hits the prefix cache, unless it asks for prompt
    logprobs: those need every position computed."""
    (prompt,) = random_prompts([40], seed=33)
    engine = make_engine(MODEL)
    engine.generate([prompt], PLAIN)
    (plain,) = engine.generate([prompt], PLAIN)
    assert plain.num_cached_tokens > 0  # the cache holds it
    (asked,) = engine.generate([prompt], ASK)
    assert asked.num_cached_tokens == 0
    check_prompt_logprobs(prompt, asked.prompt_logprobs)
    assert list(asked.token_ids) == list(plain.token_ids)
    assert_pool_free(engine)


def test_preempted_while_prefilling_it_still_gives_each_prompt_logprob_once():
    """A pool too small for both: the long prompt is preempted part-way through its prefill
    (some of its logprobs computed) and computed again, the blocks it has logprobs for from the
    prefix cache; its prompt logprobs are each position's once, as transformers gives them."""
    engine = make_engine(MODEL, block_size=4, num_blocks=12, budget=6)  # 48 tokens
    short, long = random_prompts([8, 36], seed=34)
    long_new = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    rs, rl = engine.add_request(short, long_new), engine.add_request(long, long_new)
    firsts: dict[str, tuple] = {}
    mid_prefill = []  # (logprobs held, computed tokens) of each preemption before the first token
    seen: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in firsts:
                firsts[out.request_id] = out.prompt_logprobs
        for rid, req in engine.scheduler.requests.items():
            if req.num_preemptions > seen.get(rid, 0) and rid not in firsts:
                mid_prefill.append((len(req.prompt_logprobs), req.num_computed_tokens))
            seen[rid] = req.num_preemptions
    assert any(held > 0 for held, _ in mid_prefill), mid_prefill
    check_prompt_logprobs(short, firsts[rs])
    check_prompt_logprobs(long, firsts[rl])
    assert_pool_free(engine)


def test_preempted_after_its_first_token_it_computes_them_no_more():
    """Given with its first token, the prompt's logprobs are not computed again when the
    request is preempted later and its prompt recomputed (no prefix cache to take it from),
    nor held."""
    engine = make_engine(MODEL, block_size=4, num_blocks=12, budget=6, caching=False)
    long, short = random_prompts([30, 8], seed=39)
    engine.add_request(long, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    new = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    rs = engine.add_request(short, new)
    given, again, before = None, [], 0
    orig = engine.runner.execute

    def execute(so, hook=None):
        if given is not None:
            again.extend(s for s in so.scheduled if s.request_id == rs and s.prompt_targets)
        return orig(so, hook)

    engine.runner.execute = execute
    preempted_after = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rs and out.new_token_ids and given is None:
                given = out.prompt_logprobs
                before = engine.scheduler.requests[rs].num_preemptions
        req = engine.scheduler.requests.get(rs)
        if req is not None and given is not None:
            preempted_after |= req.num_preemptions > before
            assert req.prompt_logprobs == []
    assert preempted_after  # the case this is about
    assert again == []
    check_prompt_logprobs(short, given, k=1)
    assert_pool_free(engine)


def test_one_token_chunks_beside_a_decode_give_their_logprobs():
    """A budget of two beside a running decode leaves the prompt one token a step: its chunks
    sit among the decodes' rows."""
    one_token_chunks_beside_a_decode(make_engine(MODEL, budget=2), ASK, k=3)


def one_token_chunks_beside_a_decode(engine, ask: SamplingParams, k: int) -> None:
    """On an engine of two tokens a step, a prompt asking for its logprobs joins a running
    decode (one prompt token a step): they are transformers'."""
    first, prompt = random_prompts([3, 9], seed=37)
    engine.add_request(first, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()  # it decodes now
    rid = engine.add_request(prompt, ask)
    got = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids and got is None:
                got = out.prompt_logprobs
    check_prompt_logprobs(prompt, got, k=k)
    assert_pool_free(engine)


def test_a_handoff_s_reservation_refuses_prompt_logprobs_naming_them():
    """The decode side of a handoff computes no prompt: asked for its logprobs it refuses, rather
    than receive the KV and give none."""
    engine = make_engine(MODEL)
    (prompt,) = random_prompts([12], seed=38)
    with pytest.raises(InvalidRequestError) as exc:
        engine.reserve_for_kv(prompt, ASK, "kv")
    assert exc.value.field == "prompt_logprobs"
    assert_pool_free(engine)


def test_one_token_prompt_has_no_prompt_logprobs_and_zero_alternatives_works():
    engine = make_engine(MODEL)
    one, two = random_prompts([1, 5], seed=35)
    res = engine.generate(
        [one, two], [ASK, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)]
    )
    assert res[0].prompt_logprobs == ()
    check_prompt_logprobs(two, res[1].prompt_logprobs, k=0)
    assert_pool_free(engine)


@pytest.mark.parametrize("bad", [21, -1, 2.5, True])
def test_prompt_logprobs_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(prompt_logprobs=bad)
    assert exc.value.field == "prompt_logprobs"


def test_drained_engine_holds_nothing_for_them():
    engine = make_engine(MODEL, budget=8)
    (prompt,) = random_prompts([30], seed=36)
    rid = engine.add_request(prompt, ASK)
    engine.step()
    engine.abort(rid)  # mid-prefill
    drain(engine)
    assert_pool_free(engine)
