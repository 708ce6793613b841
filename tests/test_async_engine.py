"""AsyncEngine: concurrent streams from one engine thread, cancellation, failure."""

import asyncio

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, hf_greedy, make_engine, random_prompts


async def collect(aeng, prompt, params, rid):
    toks, fins = [], []
    async for out in aeng.generate(prompt, params, rid):
        toks.extend(out.new_token_ids)
        fins.append(out.finished)
    assert fins[-1] and not any(fins[:-1])
    return toks


def test_concurrent_streams_match_transformers():
    aeng = AsyncEngine(make_engine())
    prompts = random_prompts([4, 11, 23, 37, 9, 50, 16, 30], seed=41)
    sp = SamplingParams(max_tokens=10, temperature=0.0)

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(collect(aeng, p, sp, f"r{i}") for i, p in enumerate(prompts))), 60
        )

    try:
        got = asyncio.run(main())
        for p, g in zip(prompts, got):
            assert g == hf_greedy("tiny-llama", p, 10)
        assert_pool_free(aeng.engine)
    finally:
        aeng.shutdown()


def test_caller_that_stops_reading_aborts_its_request():
    aeng = AsyncEngine(make_engine())
    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        gen = aeng.generate(random_prompts([20], seed=42)[0], sp, "cancel-me")
        async for _ in gen:
            break  # a client that goes away after the first token
        await gen.aclose()
        for _ in range(100):  # the abort reaches the engine thread between steps
            if await aeng.call(lambda e: not e.has_unfinished_requests()):
                return
            await asyncio.sleep(0.02)
        raise AssertionError("request still running after its reader left")

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert_pool_free(aeng.engine)
    finally:
        aeng.shutdown()


def test_failed_step_ends_streams_with_error_and_refuses_new_work():
    aeng = AsyncEngine(make_engine())
    boom = RuntimeError("step failed")

    def broken_step(on_layer=None):
        raise boom

    async def main():
        await aeng.call(lambda e: setattr(e, "step", broken_step))
        with pytest.raises(EngineDeadError):
            await collect(aeng, [1, 2, 3], SamplingParams(max_tokens=3), "x")
        with pytest.raises(EngineDeadError):
            await aeng.call(lambda e: None)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert_pool_free(aeng.engine)  # the request it held was aborted
    finally:
        aeng.shutdown()
