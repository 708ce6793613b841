"""The engine's handoff API: KV prefilled on one engine, copied block by block, decoded on
another, token for token equal to transformers (the in-process form of the disaggregated path)."""

import pytest

from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, drain, hf_greedy, make_engine, random_prompts

MAX_NEW = 10


def prefill(p_engine, prompts, params):
    """Prefill on P (first token only, blocks held); return {rid: first token}."""
    first_params = [
        SamplingParams(
            max_tokens=1, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed, ignore_eos=True
        )
        for sp in params
    ]
    rids = [p_engine.add_request(p, sp, hold_blocks=True) for p, sp in zip(prompts, first_params)]
    toks = drain(p_engine)
    return rids, {r: toks[r][0] for r in rids}


def copy_blocks(src_engine, src_blocks, dst_engine, dst_blocks):
    for src_layer, dst_layer in zip(src_engine.runner.cache.layers, dst_engine.runner.cache.layers):
        dst_layer[list(dst_blocks)] = src_layer[list(src_blocks)]


def handoff(p_engine, d_engine, prompts, params):
    rids, first = prefill(p_engine, prompts, params)
    outs: dict[str, list[int]] = {}
    for rid, prompt, sp in zip(rids, prompts, params):
        res = d_engine.reserve_for_kv(prompt, sp, request_id=rid)
        assert res is not None
        skip = res.num_cached_tokens // d_engine.config.cache.block_size
        src = p_engine.held_block_ids(rid)
        copy_blocks(p_engine, src[skip:], d_engine, res.block_ids[skip:])
        assert p_engine.release_blocks(rid)
        out = d_engine.kv_arrived(rid, first[rid])
        outs[rid] = list(out.new_token_ids)
    for rid, toks in drain(d_engine).items():
        outs[rid].extend(toks)
    return [outs[r] for r in rids]


def test_kv_landing_before_it_was_due_beside_whole_budget_steps_matches_transformers():
    """A decode worker with a step target runs its own prompt at the whole budget while a
    handoff is not yet due; the KV landing early joins that batch, and both answers equal
    transformers'."""
    arch = "tiny-llama"
    p_engine = make_engine(arch, budget=24)
    # Its sizer starts at 64-token chunks: a reservation that counted would halve the step.
    d_engine = make_engine(arch, budget=128, step_target_s=0.05)
    handed, local = random_prompts([29, 200], seed=7)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    (rid,), first = prefill(p_engine, [handed], [sp])
    res = d_engine.reserve_for_kv(handed, sp, request_id=rid, due_in_s=60.0)
    assert res is not None
    lid = d_engine.add_request(local, sp, request_id="local")
    assert d_engine.step() == [] and d_engine.scheduler.requests[lid].num_computed_tokens == 128
    skip = res.num_cached_tokens // d_engine.config.cache.block_size
    copy_blocks(p_engine, p_engine.held_block_ids(rid)[skip:], d_engine, res.block_ids[skip:])
    assert p_engine.release_blocks(rid)
    got = {rid: list(d_engine.kv_arrived(rid, first[rid]).new_token_ids)}
    for r, toks in drain(d_engine).items():
        got.setdefault(r, []).extend(toks)
    assert got[rid] == hf_greedy(arch, handed, MAX_NEW)
    assert got[lid] == hf_greedy(arch, local, MAX_NEW)
    assert_pool_free(p_engine)
    assert_pool_free(d_engine)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
def test_disaggregated_handoff_matches_transformers(arch):
    p_engine = make_engine(arch, budget=24)
    d_engine = make_engine(arch, budget=24)
    prompts = random_prompts([3, 8, 15, 16, 17, 29, 40, 63], seed=31)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0)] * len(prompts)
    got = handoff(p_engine, d_engine, prompts, params)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(arch, p, MAX_NEW), f"prompt of {len(p)} tokens"
    assert_pool_free(p_engine)
    assert_pool_free(d_engine)


def test_prefix_cached_on_decode_side_is_not_copied():
    p_engine, d_engine = make_engine(), make_engine()
    base = random_prompts([24], seed=32)[0]
    d_engine.generate([base], SamplingParams(max_tokens=2, temperature=0.0))  # caches 6 blocks
    longer = base + random_prompts([10], seed=33)[0]
    rids, first = prefill(p_engine, [longer], [SamplingParams(max_tokens=MAX_NEW, temperature=0)])
    res = d_engine.reserve_for_kv(longer, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert res.num_cached_tokens == 24  # only blocks 6.. travel
    # Poison the blocks that should not be needed on P's side: D must not read them.
    src = p_engine.held_block_ids(rids[0])
    for layer in p_engine.runner.cache.layers:
        layer[list(src[:6])] = float("nan")
    copy_blocks(p_engine, src[6:], d_engine, res.block_ids[6:])
    p_engine.release_blocks(rids[0])
    toks = list(d_engine.kv_arrived(res.request_id, first[rids[0]]).new_token_ids)
    toks += drain(d_engine)[res.request_id]
    assert toks == hf_greedy("tiny-llama", longer, MAX_NEW)
    assert_pool_free(p_engine)
    assert_pool_free(d_engine)


def test_failed_transfer_recomputes_locally():
    d_engine = make_engine()
    prompt = random_prompts([21], seed=34)[0]
    res = d_engine.reserve_for_kv(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert d_engine.kv.num_free_blocks < d_engine.runner.num_blocks
    d_engine.kv_failed(res.request_id)
    assert drain(d_engine)[res.request_id] == hf_greedy("tiny-llama", prompt, MAX_NEW)
    assert_pool_free(d_engine)


def test_seeded_sampling_same_on_both_paths():
    prompt = random_prompts([13], seed=35)[0]
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    colocated = make_engine().generate([prompt], sp)[0].token_ids
    p_engine, d_engine = make_engine(), make_engine()
    (disagg,) = handoff(p_engine, d_engine, [prompt], [sp])
    assert disagg == list(colocated)
    assert_pool_free(p_engine)
    assert_pool_free(d_engine)


def test_abort_frees_reserved_and_held_blocks():
    p_engine, d_engine = make_engine(), make_engine()
    prompt = random_prompts([30], seed=36)[0]
    rids, _ = prefill(p_engine, [prompt], [SamplingParams(max_tokens=4, temperature=0.0)])
    assert p_engine.kv.num_free_blocks < p_engine.runner.num_blocks  # held after finishing
    p_engine.abort(rids)
    res = d_engine.reserve_for_kv(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    d_engine.abort(res.request_id)
    assert not d_engine.has_unfinished_requests()
    assert_pool_free(p_engine)
    assert_pool_free(d_engine)


def test_reserve_refuses_when_slots_or_blocks_lack():
    d_engine = make_engine(num_blocks=12, budget=16, max_num_seqs=2)
    prompts = random_prompts([9, 9, 9, 40], seed=37)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    a = d_engine.reserve_for_kv(prompts[0], sp)
    b = d_engine.reserve_for_kv(prompts[1], sp)
    assert a is not None and b is not None
    assert d_engine.reserve_for_kv(prompts[2], sp) is None  # no sequence slot left
    d_engine.abort([a.request_id])
    assert d_engine.reserve_for_kv(prompts[3], sp) is None  # 40 tokens need 10 blocks; 9 free
    d_engine.abort([b.request_id])
    assert_pool_free(d_engine)


def test_first_token_eos_finishes_at_once():
    d_engine = make_engine()
    prompt = random_prompts([5], seed=38)[0]
    res = d_engine.reserve_for_kv(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    eos = next(iter(d_engine.eos_token_ids))
    out = d_engine.kv_arrived(res.request_id, eos)
    assert out.finished and out.finish_reason is FinishReason.STOP
    assert_pool_free(d_engine)


def test_reservations_past_their_share_are_refused_and_prefills_keep_the_rest():
    """A worker that also prefills for peers lets reservations hold at most `share` of its slots
    and blocks; the rest stays for prefills (else two such workers, each full of reservations
    for KV the other has yet to prefill, stall each other)."""
    eng = make_engine(num_blocks=40, max_num_seqs=8)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    small = random_prompts([8] * 5, seed=34)  # two blocks each
    # Slots: 4 of 8.
    got = [eng.reserve_for_kv(p, params, share=0.5) for p in small]
    assert [r is not None for r in got] == [True] * 4 + [False]
    eng.abort([r.request_id for r in got if r is not None])
    # Blocks: 4 held, and a prompt of 17 blocks would make 21 of 40, past half.
    held = [eng.reserve_for_kv(p, params, share=0.5) for p in small[:2]]
    big = random_prompts([66], seed=35)[0]
    assert eng.reserve_for_kv(big, params, share=0.5) is None
    assert len(eng.scheduler.waiting_for_kv) == 2  # the refusal reserved nothing
    whole = eng.reserve_for_kv(big, params, share=1.0)  # a worker that only decodes
    assert whole is not None
    eng.abort(whole.request_id)
    # With reservations at their share, a prefill here still runs to the end, token for token.
    held += [eng.reserve_for_kv(p, params, share=0.5) for p in small[2:4]]
    assert all(h is not None for h in held) and len(eng.scheduler.waiting_for_kv) == 4
    local = random_prompts([21], seed=36)[0]
    rid = eng.add_request(local, params)
    toks: list[int] = []
    for _ in range(100):  # the reservations never finish: step until this request has
        for out in eng.step():
            toks.extend(out.new_token_ids)
        if rid not in eng.scheduler.requests:
            break
    assert toks == hf_greedy("tiny-llama", local, MAX_NEW)
    eng.abort([h.request_id for h in held if h is not None])
    assert_pool_free(eng)
