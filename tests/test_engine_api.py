"""LLMEngine's API: refusals that name the field, stops, limits, abort, streaming text."""

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.errors import InvalidRequestError, KVCacheAllocationError, ModelNotFoundError
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.request import FinishReason, RequestStatus
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, drain, hf_greedy, make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _bad_requests(engine: LLMEngine, taken_id: str):
    """(case, call, field, fragments the message must contain) for each kind of bad input."""
    n, vocab = engine.max_model_len, engine.vocab_size
    return [
        ("empty list", lambda: engine.add_request([]), "prompt", ["empty"]),
        ("empty text", lambda: engine.add_request(""), "prompt", ["empty"]),
        ("too long", lambda: engine.add_request([1] * n), "prompt", [str(n - 1), str(n)]),
        ("id >= vocab", lambda: engine.add_request([1, vocab]), "prompt_token_ids", [f"{vocab})"]),
        ("id < 0", lambda: engine.add_request([1, -1]), "prompt_token_ids", ["-1", "[0, "]),
        ("max_tokens 0", lambda: SamplingParams(max_tokens=0), "max_tokens", [">= 1"]),
        ("temperature -1", lambda: SamplingParams(temperature=-1), "temperature", [">= 0"]),
        ("top_p 0", lambda: SamplingParams(top_p=0.0), "top_p", ["(0, 1]"]),
        ("top_p 1.5", lambda: SamplingParams(top_p=1.5), "top_p", ["(0, 1]"]),
        # A bool is no integer here: logprobs=True reached torch.topk and failed every step of
        # every request in the engine; max_tokens=True ran as 1.
        ("top_k True", lambda: SamplingParams(top_k=True), "top_k", ["integer"]),
        ("logprobs True", lambda: SamplingParams(logprobs=True), "logprobs", ["integer"]),
        ("max_tokens True", lambda: SamplingParams(max_tokens=True), "max_tokens", ["integer"]),
        ("seed True", lambda: SamplingParams(seed=True), "seed", ["integer"]),
        ("stop id True", lambda: SamplingParams(stop_token_ids=[True]), "stop_token_ids", [">="]),
        ("temperature str", lambda: SamplingParams(temperature="0.5"), "temperature", ["number"]),
        ("top_p None", lambda: SamplingParams(top_p=None), "top_p", ["number"]),
        ("top_p 10**400", lambda: SamplingParams(top_p=10**400), "top_p", ["number"]),
        (
            "penalty str",
            lambda: SamplingParams(repetition_penalty="2"),
            "repetition_penalty",
            ["number"],
        ),
        ("bias 5", lambda: SamplingParams(logit_bias=5), "logit_bias", ["pairs"]),
        ("65 stops", lambda: SamplingParams(stop=["x"] * 65), "stop", ["65", "at most 64"]),
        ("ignore_eos str", lambda: SamplingParams(ignore_eos="no"), "ignore_eos", ["true or"]),
        ("id 5.7", lambda: engine.add_request([1, 5.7]), "prompt_token_ids", ["5.7"]),
        ("id '5'", lambda: engine.add_request([1, "5"]), "prompt_token_ids", ["'5'"]),
        ("id True", lambda: engine.add_request([1, True]), "prompt_token_ids", ["True"]),
        (
            "params dict",
            lambda: engine.add_request([1, 2], {"max_tokens": 2}),
            "sampling_params",
            ["dict"],
        ),
        (
            "duplicate id",
            lambda: engine.add_request([1, 2], request_id=taken_id),
            "request_id",
            [taken_id],
        ),
    ]


def _check_refused(call, field: str, fragments: list[str], case: str = "") -> None:
    with pytest.raises(InvalidRequestError) as info:
        call()
    assert info.value.field == field, case
    for frag in fragments + [field]:
        assert frag in str(info.value), f"{case}: {frag!r} missing from {info.value}"


def test_reset_totals_counts_from_zero_again():
    engine = make_engine("tiny-llama")
    prompt = random_prompts([40], seed=46)[0]
    engine.generate([prompt], GREEDY)
    engine.generate([prompt], GREEDY)  # finds the first's blocks
    stats = engine.kv.pool.stats
    assert engine.step_stats.busy_s > 0 and stats.queries > 0 and stats.hits > 0
    engine.reset_totals()
    stats = engine.kv.pool.stats
    assert (engine.step_stats.busy_s, stats.queries, stats.hits) == (0.0, 0, 0)
    assert engine.scheduler.num_preemptions == 0 and not engine.step_stats.drain()
    engine.generate([prompt], GREEDY)  # cached still: what comes next is counted anew
    assert engine.kv.pool.stats.queries == len(prompt) and engine.kv.pool.stats.hits > 0
    assert_pool_free(engine)


def test_seed_minus_one_is_no_seed():
    assert SamplingParams(seed=-1, temperature=1.0).seed is None  # vLLM's reading
    _check_refused(lambda: SamplingParams(seed=-2), "seed", ["[0, 2**64)"])


def test_each_bad_input_is_refused_naming_field_and_range():
    engine = make_engine("tiny-llama")
    engine.add_request([1, 2, 3], GREEDY, request_id="taken")
    for case, call, field, fragments in _bad_requests(engine, "taken"):
        _check_refused(call, field, fragments, case)
    engine.abort("taken")
    assert not engine.has_unfinished_requests()
    assert_pool_free(engine)


def test_bad_inputs_while_running_leave_the_running_request_intact():
    engine = make_engine("tiny-llama", block_size=4, budget=8)
    prompt = random_prompts([13], seed=31)[0]
    rid = engine.add_request(prompt, GREEDY, request_id="live")
    toks: list[int] = []
    for _ in range(3):  # two prefill chunks, then a decode
        for out in engine.step():
            toks.extend(out.new_token_ids)
    assert len(toks) == 2 and engine.scheduler.requests[rid].status is RequestStatus.RUNNING
    for case, call, field, fragments in _bad_requests(engine, rid):
        _check_refused(call, field, fragments, case)
    toks.extend(drain(engine).get(rid, []))
    assert toks == hf_greedy("tiny-llama", prompt, GREEDY.max_tokens)
    assert not engine.scheduler.requests
    assert_pool_free(engine)


def test_a_kv_cache_too_large_for_the_device_names_the_setting(monkeypatch):
    import engine.model_runner

    with pytest.raises(KVCacheAllocationError) as info:
        # On a CPU, where the setting applies (gpu-check.sh runs this file with CUDA present).
        LLMEngine(EngineConfig(model=ModelConfig(model="tiny-llama", device="cpu"),
                               cache=CacheConfig(cpu_kv_cache_gib=100_000)))  # fmt: skip
    said = str(info.value)
    assert said.startswith("the KV cache does not fit on cpu: ") and "100000.0 GiB" in said
    assert "from cache.cpu_kv_cache_gib 100000; ask for less (" in said, said

    def failing(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.model_runner, "KVCache", failing)
    with pytest.raises(RuntimeError, match="illegal memory access") as info:  # not "ask for less"
        LLMEngine(EngineConfig(model=ModelConfig(model="tiny-llama")))
    assert not isinstance(info.value, KVCacheAllocationError)


def test_unknown_model_is_named():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLMEngine(EngineConfig(model=ModelConfig(model="no-such-model")))


def _greedy_text(engine: LLMEngine, prompt: list[int]) -> str:
    (res,) = engine.generate([prompt], GREEDY)
    return res.text


def _pick_stop(text: str) -> str:
    """A 3-character piece of `text` from its middle, free of replacement characters."""
    for i in range(len(text) // 3, len(text) - 3):
        piece = text[i : i + 3]
        if "\ufffd" not in piece and piece.strip():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_text_and_is_never_streamed(include):
    engine = make_engine("tiny-llama")
    prompt = random_prompts([9], seed=41)[0]
    full = _greedy_text(engine, prompt)
    stop = _pick_stop(full)
    end = full.index(stop)
    params = SamplingParams(
        max_tokens=GREEDY.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        stop=(stop, "never-produced"),
        include_stop_str_in_output=include,
    )
    rid = engine.add_request(prompt, params)
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.text_delta)
            last = out
    text = "".join(deltas)
    assert last is not None and last.finished
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == stop
    assert text == (full[: end + len(stop)] if include else full[:end])
    if not include:
        assert all(stop not in d for d in deltas)
        assert stop not in text
    assert_pool_free(engine)


def test_without_detokenizing_only_stop_strings_decode_text():
    """Workers run with detokenize off (the router decodes text): tokens are the same, a request
    without stop strings gets no text, and one with stop strings still stops where they match."""
    prompt = random_prompts([9], seed=41)[0]
    full = _greedy_text(make_engine("tiny-llama"), prompt)
    stop = _pick_stop(full)
    stopping = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    want = make_engine("tiny-llama").generate([prompt, prompt], [GREEDY, stopping])
    quiet = make_engine("tiny-llama", detokenize=False)
    plain, stopped = quiet.generate([prompt, prompt], [GREEDY, stopping])
    assert plain.token_ids == want[0].token_ids and plain.text == ""
    assert stopped.token_ids == want[1].token_ids and len(stopped.token_ids) < 24
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == stop
    assert stopped.text == want[1].text == full[: full.index(stop)]
    assert_pool_free(quiet)


def test_stop_token_ids():
    engine = make_engine("tiny-llama")
    prompt = random_prompts([7], seed=43)[0]
    (free,) = engine.generate([prompt], GREEDY)
    target = free.token_ids[6]
    first = free.token_ids.index(target)
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(target,)
    )
    (res,) = engine.generate([prompt], params)
    assert res.token_ids == free.token_ids[: first + 1]
    assert res.finish_reason is FinishReason.STOP and res.stop_reason == target
    assert_pool_free(engine)


def test_max_tokens_is_honoured():
    engine = make_engine("tiny-llama")
    prompts = random_prompts([5, 12], seed=44)
    capped = engine.generate(
        prompts, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    )
    for r in capped:
        assert len(r.token_ids) == 7 and r.finish_reason is FinishReason.LENGTH
    res = engine.generate(prompts, SamplingParams(max_tokens=7, temperature=0.9, seed=3))
    for r in res:
        assert len(r.token_ids) <= 7
    assert [r.prompt_token_ids for r in res] == [tuple(p) for p in prompts]
    assert_pool_free(engine)


def test_generate_refusing_one_prompt_queues_none():
    engine = make_engine("tiny-llama")
    with pytest.raises(InvalidRequestError) as info:
        engine.generate([[1, 2], [3, 4], []], GREEDY)
    assert info.value.field == "prompt" and str(info.value).endswith("(prompt 3 of 3)")
    assert not engine.has_unfinished_requests()
    assert_pool_free(engine)


def test_generate_takes_a_string_as_one_prompt_and_refuses_bare_ids_naming_prompts():
    """As vLLM's LLM.generate: a string is one prompt (it ran one prompt per character); a
    list of token ids not wrapped in a list is refused naming the field (a bare TypeError)."""
    engine = make_engine("tiny-llama")
    (one,) = engine.generate("hello there", GREEDY)
    assert one.prompt_token_ids == tuple(engine.encode("hello there"))
    with pytest.raises(InvalidRequestError) as info:
        engine.generate([1, 2, 3], GREEDY)
    assert info.value.field == "prompts" and "pass [ids]" in str(info.value)
    assert not engine.has_unfinished_requests()
    assert_pool_free(engine)


def test_abort_running_and_waiting_frees_blocks_and_others_continue():
    # Two running slots: the third and fourth requests wait.
    engine = make_engine("tiny-llama", max_num_seqs=2, budget=16)
    prompts = random_prompts([6, 9, 5, 8], seed=45)
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    toks: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
    running = {r.request_id for r in engine.scheduler.running}
    waiting = {r.request_id for r in engine.scheduler.waiting}
    assert rids[1] in running and rids[3] in waiting
    engine.abort([rids[1], rids[3], "unknown-id"])
    for rid, t in drain(engine).items():
        assert rid not in (rids[1], rids[3])
        toks.setdefault(rid, []).extend(t)
    for i in (0, 2):
        assert toks[rids[i]] == hf_greedy("tiny-llama", prompts[i], GREEDY.max_tokens)
    assert_pool_free(engine)


def test_context_limit_ends_with_length():
    loaded = load_model(ModelConfig(model="tiny-llama", max_model_len=40))
    cfg = EngineConfig(model=ModelConfig(model="tiny-llama"), cache=CacheConfig(4, 64))
    engine = LLMEngine(cfg, loaded)
    assert engine.max_model_len == 40
    prompts = random_prompts([30, 39], seed=46)
    res = engine.generate(prompts, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    assert [len(r.token_ids) for r in res] == [10, 1]
    assert all(r.finish_reason is FinishReason.LENGTH for r in res)
    _check_refused(lambda: engine.add_request([1] * 40), "prompt", ["39", "40"])
    assert_pool_free(engine)


def test_request_outgrowing_the_pool_is_reported_finished():
    # 4 blocks of 4 tokens hold 16: the request is ended by the pool, not by max_tokens.
    engine = make_engine("tiny-llama", block_size=4, num_blocks=4)
    (res,) = engine.generate([[1, 2, 3, 4, 5]], GREEDY)
    assert res.finish_reason is FinishReason.LENGTH and res.stop_reason == "kv_cache_capacity"
    assert len(res.token_ids) < GREEDY.max_tokens
    assert not engine.has_unfinished_requests()
    assert_pool_free(engine)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_streamed_deltas_equal_final_decode_on_utf8_text(name):
    engine = make_engine(name, budget=16)
    texts = ["héllo wörld, ça va? ß ", "日本語のテキスト、中文", "emoji 🙂🚀 👩‍👩‍👧 🇫🇷"]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    rids = [engine.add_request(t, params) for t in texts]
    deltas: dict[str, list[str]] = {r: [] for r in rids}
    toks: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id].append(out.text_delta)
            toks[out.request_id].extend(out.new_token_ids)
    for rid in rids:
        expect = engine.tokenizer.decode(toks[rid], skip_special_tokens=True)
        assert "".join(deltas[rid]) == expect
    # The prompts really do split characters across tokens.
    assert len(engine.encode(texts[1])) > len(texts[1])
    assert_pool_free(engine)


def test_a_requests_own_hold_reaches_its_scheduler_request_and_outlives_a_failed_handoff():
    """add_request and reserve_for_kv give the scheduler's request the hold they were given
    (None: the scheduler's own); a handoff whose KV never came keeps it for its recompute; one
    out of range is refused naming the field, and nothing is left behind."""
    engine = make_engine("tiny-llama")
    a, b = random_prompts([9, 13], seed=5)
    engine.add_request(a, GREEDY, "own", prefill_hold_s=2.0)
    engine.add_request(b, GREEDY, "none")
    assert engine.scheduler.requests["own"].prefill_hold_s == 2.0
    assert engine.scheduler.requests["none"].prefill_hold_s is None
    assert engine.reserve_for_kv(b, GREEDY, "kv", prefill_hold_s=3.0) is not None
    engine.kv_failed("kv")
    assert engine.scheduler.requests["kv"].prefill_hold_s == 3.0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidRequestError, match="prefill_hold_s"):
            engine.add_request(a, GREEDY, f"bad-{bad}", prefill_hold_s=bad)
        with pytest.raises(InvalidRequestError, match="prefill_hold_s"):
            engine.reserve_for_kv(a, GREEDY, f"bad-kv-{bad}", prefill_hold_s=bad)
    drain(engine)
    assert_pool_free(engine)


def test_a_workers_load_says_how_far_each_prompt_has_come():
    """WorkerLoad.prefills_left: each waiting or prefilling request's prompt tokens still to
    compute, by the request id the router placed it under (its books read how far each
    prefill has come from it); queued_prefill_tokens counts a running prefill's last token with
    its first decode."""
    from worker_protocol.host import engine_load
    from worker_protocol.messages import WorkerRole

    engine = make_engine("tiny-llama", budget=16, caching=False)
    a, b = random_prompts([40, 30], seed=4)
    engine.add_request(a, GREEDY, request_id="a")
    engine.add_request(b, GREEDY, request_id="b")
    assert dict(engine_load(engine, "p", WorkerRole.PREFILL).prefills_left) == {"a": 40, "b": 30}
    engine.step()  # 16 of a's 40
    load = engine_load(engine, "p", WorkerRole.PREFILL)
    assert dict(load.prefills_left) == {"a": 24, "b": 30}
    assert load.queued_prefill_tokens == 23 + 30
    drain(engine)
    assert_pool_free(engine)
    assert engine_load(engine, "p", WorkerRole.PREFILL).prefills_left == ()


def test_a_step_that_only_prefills_waits_for_its_device_and_every_steps_seconds_count_busy(
    monkeypatch,
):
    """A chunk that samples nothing reads nothing back, so on CUDA nothing would wait for its
    kernels: the runner settles the device then (and only then), so that the step's seconds
    are the device's. The seconds of every step add up to the worker's busy seconds."""
    from engine import model_runner
    from worker_protocol.host import engine_load
    from worker_protocol.messages import WorkerRole

    settled = []
    monkeypatch.setattr(model_runner, "settle", settled.append)
    engine = make_engine("tiny-llama", budget=16, caching=False)
    (prompt,) = random_prompts([40], seed=5)
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()  # 16 of 40: nothing sampled
    assert settled == [engine.runner.device]
    drain(engine)
    assert len(settled) == 2  # 16 more; the last 8 sample the first token, then two decodes
    steps = engine.step_stats.drain()
    assert len(steps) == 5 and engine.step_stats.total_steps == 5
    busy = engine_load(engine, "p", WorkerRole.PREFILL).busy_s
    assert busy == engine.step_stats.busy_s == pytest.approx(sum(s.seconds for s in steps))
    assert busy > 0
    assert_pool_free(engine)


def test_a_workers_load_reports_its_smallest_chunks_step_and_the_hold_used(monkeypatch):
    """What the router prices holds and chunks by (WorkerLoad.chunk_floor_s, hold_left_s)
    comes from the engine's scheduler as it stands."""
    from worker_protocol.host import engine_load
    from worker_protocol.messages import WorkerRole

    clock = [100.0]
    monkeypatch.setattr("engine.scheduler.time.monotonic", lambda: clock[0])
    engine = make_engine("tiny-llama", step_target_s=0.1, prefill_hold_s=5.0)
    sizer = engine.scheduler.sizer
    assert sizer is not None
    for _ in range(3):
        sizer.observe(16, 1, 0.130)  # a 16-token chunk beside a decode: past the target
        sizer.observe(0, 1, 0.040)
    d, p = random_prompts([5, 40], seed=3)
    engine.add_request(d, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while not any(r.num_output_tokens for r in engine.scheduler.running):
        engine.step()
    engine.add_request(p, GREEDY)
    engine.step()  # held: the decode ends within the hold
    clock[0] += 0.25
    load = engine_load(engine, "decode-0", WorkerRole.DECODE)
    assert load.chunk_floor_s == 0.130 and load.prompt_wait_steps >= 1
    assert load.hold_left_s is not None and abs(load.hold_left_s - 4.75) < 1e-9
    drain(engine)
    assert_pool_free(engine)


def test_numpy_and_tensor_integers_are_taken_as_ints():
    import numpy as np
    import torch

    params = SamplingParams(max_tokens=np.int64(3), top_k=np.int32(5), temperature=np.float32(0))
    assert (type(params.max_tokens), type(params.top_k)) == (int, int)
    assert SamplingParams(stop_token_ids=np.array([7, 9])).stop_token_ids == (7, 9)
    assert SamplingParams(stop_token_ids=np.int64(7)).stop_token_ids == (7,)
    for bad in (True, -1, 2**64, "7"):
        with pytest.raises(ValueError, match="sampling_seed"):
            ModelConfig(sampling_seed=bad)
    assert params.greedy and params == SamplingParams(max_tokens=3, top_k=5, temperature=0.0)
    engine = make_engine("tiny-llama")
    prompt = random_prompts([9], seed=33)[0]
    engine.add_request(np.array(prompt), params, request_id="np")
    engine.add_request(torch.tensor(prompt), params, request_id="pt")
    got = drain(engine)
    assert got["np"] == got["pt"] == hf_greedy("tiny-llama", prompt, 3)[: len(got["np"])]
    assert_pool_free(engine)
