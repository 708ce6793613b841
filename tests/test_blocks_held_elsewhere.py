"""A request that fits the pool, out of blocks because others hold them for a while (a decode
worker's reservations for KV on its way, a prefill worker's blocks kept for a send), waits for
them: it is not ended as too long for the pool (finish_reason length, kv_cache_capacity, with
no token), and once they come back it gives transformers' greedy tokens."""

from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, drain, hf_greedy, make_engine, random_prompts

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _steps(engine, n: int) -> list:
    outs = []
    for _ in range(n):
        outs += engine.step()
    return outs


def test_a_request_waits_for_blocks_reserved_for_kv_on_its_way():
    engine = make_engine("tiny-llama", block_size=4, num_blocks=64)  # 256 tokens
    big_a, big_b, prompt = random_prompts([100, 100, 60], seed=11)
    for rid, p in (("kv-a", big_a), ("kv-b", big_b)):  # 25 blocks each: 14 left
        assert engine.reserve_for_kv(p, GREEDY, rid) is not None
    engine.add_request(prompt, GREEDY, "local")  # 21 blocks in all
    outs = _steps(engine, 20)
    assert not [o for o in outs if o.request_id == "local"], outs  # no token, not ended
    assert engine.scheduler.requests["local"].finish_reason is None
    engine.abort(["kv-a", "kv-b"])  # their KV never comes: the blocks come back
    toks = drain(engine)
    assert toks["local"] == hf_greedy("tiny-llama", prompt, NEW)
    assert_pool_free(engine)


def test_a_request_waits_for_blocks_kept_for_a_send():
    engine = make_engine("tiny-llama", block_size=4, num_blocks=64)
    sent_a, sent_b, prompt = random_prompts([100, 100, 60], seed=12)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    for rid, p in (("send-a", sent_a), ("send-b", sent_b)):
        engine.add_request(p, first, rid, hold_blocks=True)
    drain(engine)  # both prompts done; their blocks kept for their sends
    assert engine.held_block_ids("send-a") and engine.held_block_ids("send-b")
    engine.add_request(prompt, GREEDY, "local")
    outs = _steps(engine, 20)
    assert not [o for o in outs if o.request_id == "local"], outs
    for rid in ("send-a", "send-b"):
        assert engine.release_blocks(rid)
    toks = drain(engine)
    assert toks["local"] == hf_greedy("tiny-llama", prompt, NEW)
    assert_pool_free(engine)


def test_the_wait_for_blocks_held_elsewhere_has_a_deadline(monkeypatch):
    """Blocks held for longer than BLOCKS_WAIT_S (a reservation whose prefill is queued behind
    this very request on another worker): the request ends there (length, kv_cache_capacity),
    with the tokens it had, greedy's, rather than wait on."""
    import time

    from engine import scheduler

    monkeypatch.setattr(scheduler, "BLOCKS_WAIT_S", 0.5)
    engine = make_engine("tiny-llama", block_size=4, num_blocks=64)
    big, prompt = random_prompts([200, 40], seed=15)
    assert engine.reserve_for_kv(big, GREEDY, "kv") is not None  # 50 blocks: 14 left
    engine.add_request(prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                       "local")  # fmt: skip
    toks: list[int] = []
    ended = None
    t0 = time.monotonic()
    while ended is None:
        assert time.monotonic() - t0 < 30
        for out in engine.step():
            toks += out.new_token_ids
            if out.finished:
                ended = out
    assert time.monotonic() - t0 >= 0.5
    assert ended.finish_reason is FinishReason.LENGTH and ended.stop_reason == "kv_cache_capacity"
    assert len(prompt) + len(toks) == 14 * 4 + 1  # its 14 blocks full, and a token past them
    assert toks == hf_greedy("tiny-llama", prompt, len(toks))
    engine.abort("kv")
    assert_pool_free(engine)


def test_a_request_the_whole_pool_cannot_hold_still_ends_there():
    """Nothing else holding blocks: alone and out of them, it ends (length,
    kv_cache_capacity), as before."""
    engine = make_engine("tiny-llama", block_size=4, num_blocks=16)  # 64 tokens
    (prompt,) = random_prompts([40], seed=13)
    engine.add_request(prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    outs = [o for _ in range(200) for o in engine.step() if o.finished]
    assert len(outs) == 1 and outs[0].finish_reason is FinishReason.LENGTH
    assert outs[0].stop_reason == "kv_cache_capacity"
    assert_pool_free(engine)


def test_an_engine_thread_with_nothing_it_can_run_does_not_spin():
    """Waiting for blocks, the engine thread steps about once a millisecond (or at a command),
    not as fast as it can, taking the core a KV receive needs."""
    import time

    from engine.async_engine import AsyncEngine

    engine = make_engine("tiny-llama", block_size=4, num_blocks=64)
    big_a, big_b, prompt = random_prompts([100, 100, 60], seed=14)
    for rid, p in (("kv-a", big_a), ("kv-b", big_b)):
        assert engine.reserve_for_kv(p, GREEDY, rid) is not None
    steps = [0]
    step = engine.step

    def counted(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    engine.step = counted
    aeng = AsyncEngine(engine)
    try:
        aeng.call_threadsafe(lambda e: e.add_request(prompt, GREEDY, "local")).result(10)
        time.sleep(0.3)
        before, t0 = steps[0], time.monotonic()
        time.sleep(0.5)
        rate = (steps[0] - before) / (time.monotonic() - t0)
        assert 0 < rate < 1500, rate  # about 1000 a second at most; a spin is many more
        aeng.call_threadsafe(lambda e: e.abort(["kv-a", "kv-b"])).result(10)
        deadline = time.monotonic() + 60
        while aeng.call_threadsafe(lambda e: e.has_unfinished_requests()).result(10):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        aeng.shutdown()
    assert_pool_free(engine)
