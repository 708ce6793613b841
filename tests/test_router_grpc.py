"""The router end to end over gRPC on 127.0.0.1: a real server, 1 prefill x 2 decode Ray workers
with a tiny model, and the blocking gRPC client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.cluster import ClusterConfig
from router.policy import Policy, PolicyConfig
from router.serve_config import ServeConfig
from tests.grpc_server import ServerThread
from tests.helpers import hf_greedy, random_prompts

MAX_NEW = 10
MODEL = "tiny-llama"  # vocabulary 259, context 1024


@pytest.fixture(scope="module")
def srv():
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
    )
    config = ServeConfig(
        cluster=ClusterConfig(
            model=MODEL, num_prefill=1, num_decode=2, engine=engine, kv_transfer_deadline_s=10
        ),
        port=0,
        metrics_port=0,
        drain_timeout_s=5,
    )
    s = ServerThread(config)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def pools_full_after_each_test(srv):
    """After each test every live worker's pool is full and idle, and the router's books are
    empty."""
    yield
    assert_pools_full(srv, within_s=5)


@pytest.fixture(scope="module")
def stub(srv):
    with grpc.insecure_channel(srv.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def set_policy(srv, policy: Policy, **kw) -> None:
    planner = srv.server.core.planner
    planner.config = replace(PolicyConfig(), policy=policy, **kw)


def assert_pools_full(srv, within_s: float = 0.0) -> None:
    """Every worker's pool is full and idle, and the router's books are empty, now or within
    `within_s` seconds."""
    deadline = time.monotonic() + within_s
    core = srv.server.core
    while True:
        cluster = srv.server.cluster
        loads = srv.run(cluster.load(10.0))
        # Every worker answered: one that did not would pass these checks unseen.
        assert {ld.worker_id for ld in loads} == {h.worker_id for h in cluster.pools.live()}
        busy = [
            ld
            for ld in loads
            if ld.num_free_blocks != ld.num_blocks
            or ld.running
            or ld.waiting
            or ld.held
            or ld.waiting_for_kv
            or ld.open_transfers
        ]
        if not busy and core.pending == 0 and core.active == 0:
            break
        assert time.monotonic() < deadline, (
            [
                (
                    ld.worker_id,
                    f"free {ld.num_free_blocks}/{ld.num_blocks}",
                    f"running {ld.running} waiting {ld.waiting} held {ld.held}",
                    f"waiting_for_kv {ld.waiting_for_kv} open_transfers {ld.open_transfers}",
                )
                for ld in busy
            ],
            f"router pending {core.pending} active {core.active}",
        )
        time.sleep(0.02)


def received(srv) -> tuple[int, int]:
    """KV bytes received and transfers completed, over every decode worker so far."""
    stats = srv.run(srv.server.cluster.kv_stats())
    decode = [s for w, s in stats.items() if w.startswith("decode")]
    return sum(s.bytes_received for s in decode), sum(s.ok for s in decode)


def assert_handed_off(srv, before: tuple[int, int], finals) -> None:
    """Every disaggregated request among `finals` got its KV from the prefill worker: each one
    completed a transfer, bytes moved, and none fell back to a local prefill."""
    dis = [f for f in finals if f.path == pb.PATH_DISAGGREGATED]
    assert all(f.kv_fallback == "" for f in dis), [f.kv_fallback for f in dis]
    nbytes, ok = received(srv)
    assert ok - before[1] == len(dis)
    assert (nbytes > before[0]) == bool(dis)


def greedy(ids, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, **kw)
    )


def stream_tokens(stub, req, timeout=60):
    msgs = list(stub.Generate(req, timeout=timeout))
    assert all(not m.HasField("final") for m in msgs[:-1]) and msgs[-1].HasField("final")
    return [t for m in msgs for t in m.token_ids], msgs[-1].final


def unary_tokens(stub, req, timeout=60):
    resp = stub.Complete(req, timeout=timeout)
    return list(resp.token_ids), resp.final


@pytest.mark.timeout(120)
def test_a_handoff_reports_its_prefill_worker_s_prefix_cache_hit(srv, stub):
    """A 64-token prompt served colocated (a decode worker holds its blocks), then handed off
    twice: the first handoff's prefill worker computes all of it (cached 0, though the decode
    worker it likely goes to holds 60 tokens), the second finds 60 there (15 blocks of 4; the
    last token is always computed): what the answers say, with the right tokens."""
    [prompt] = random_prompts([64], seed=404)
    want = hf_greedy(MODEL, prompt, MAX_NEW)
    toks, colocated = unary_tokens(stub, replace_path(greedy(prompt), pb.PATH_COLOCATED))
    assert toks == want and colocated.usage.cached_prompt_tokens == 0
    req = replace_path(greedy(prompt), pb.PATH_DISAGGREGATED)
    # Each handoff completes a transfer that moves KV bytes, and neither falls back.
    before = received(srv)
    first_toks, first = unary_tokens(stub, req)
    assert_handed_off(srv, before, [first])
    before = received(srv)
    again_toks, again = unary_tokens(stub, req)
    assert_handed_off(srv, before, [again])
    assert first_toks == again_toks == want
    assert first.path == again.path == pb.PATH_DISAGGREGATED and not again.kv_fallback
    assert (first.usage.cached_prompt_tokens, again.usage.cached_prompt_tokens) == (0, 60)


def replace_path(req: pb.GenerateRequest, path: int) -> pb.GenerateRequest:
    req.path = path
    return req


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", list(Policy))
def test_every_policy_matches_transformers_streaming_and_unary(srv, stub, policy):
    set_policy(srv, policy, threshold_tokens=20, threshold_queue=100)
    # Fresh prompts per policy: an earlier policy's prompts sit in the prefix caches.
    prompts = random_prompts([3, 9, 16, 17, 25, 33, 48, 61], seed=71 + list(Policy).index(policy))
    calls = [stream_tokens if i % 2 == 0 else unary_tokens for i in range(len(prompts))]
    before = received(srv)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(call, stub, greedy(p)) for call, p in zip(calls, prompts)]
        results = [f.result(timeout=120) for f in futs]
    for p, (toks, final) in zip(prompts, results):
        assert toks == hf_greedy(MODEL, p, MAX_NEW), f"{policy}: prompt of {len(p)} tokens"
        assert final.usage.prompt_tokens == len(p)
        assert final.usage.completion_tokens == len(toks)
        assert final.decode_worker in ("decode-0", "decode-1")
        assert final.ttft_ms > 0 and final.decision_reason
        assert {pr.path for pr in final.predictions} == {pb.PATH_COLOCATED, pb.PATH_DISAGGREGATED}
        expected = {
            Policy.COLOCATED: pb.PATH_COLOCATED,
            Policy.DISAGGREGATED: pb.PATH_DISAGGREGATED,
            Policy.THRESHOLD: pb.PATH_DISAGGREGATED if len(p) > 20 else pb.PATH_COLOCATED,
        }.get(policy)
        if expected is not None:
            assert final.path == expected, (len(p), final.decision_reason)
        if final.path == pb.PATH_DISAGGREGATED:
            assert final.prefill_worker == "prefill-0"
    assert_handed_off(srv, before, [final for _, final in results])
    assert_pools_full(srv, within_s=2)


def test_text_prompt_streams_text_and_the_client_override_wins(srv, stub):
    set_policy(srv, Policy.COLOCATED)
    req = pb.GenerateRequest(
        prompt="hello, world",
        sampling=pb.SamplingParams(max_tokens=6, temperature=0.0),
        path=pb.PATH_DISAGGREGATED,
    )
    before = received(srv)
    msgs = list(stub.Generate(req, timeout=60))
    final = msgs[-1].final
    assert final.path == pb.PATH_DISAGGREGATED
    assert_handed_off(srv, before, [final])
    assert final.decision_reason == "disaggregated: requested by the client"
    assert final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert all(m.request_id == msgs[0].request_id for m in msgs) and msgs[0].request_id
    assert_pools_full(srv, within_s=2)


def test_prompt_logprobs_come_in_the_first_message_from_the_colocated_path(srv, stub):
    """Under a policy that hands every prompt off, a request asking for prompt logprobs is
    prefilled where it decodes; its first message brings one per prompt token after the first,
    as transformers' logits give them, and no later message brings any."""
    from tests.test_prompt_logprobs import check_prompt_logprobs

    set_policy(srv, Policy.DISAGGREGATED)
    (prompt,) = random_prompts([40], seed=97)  # more than one 32-token step
    req = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, prompt_logprobs=2),
    )
    msgs = list(stub.Generate(req, timeout=60))
    final = msgs[-1].final
    assert final.path == pb.PATH_COLOCATED and not final.prefill_worker
    assert "prompt logprobs" in final.decision_reason, final.decision_reason
    assert [t for m in msgs for t in m.token_ids] == hf_greedy(MODEL, prompt, MAX_NEW)
    first = next(i for i, m in enumerate(msgs) if m.token_ids)
    assert all(not m.prompt_logprobs for i, m in enumerate(msgs) if i != first)
    check_prompt_logprobs(prompt, msgs[first].prompt_logprobs, k=2)
    whole = stub.Complete(req, timeout=60)
    assert list(whole.prompt_logprobs) == list(msgs[first].prompt_logprobs)
    assert_pools_full(srv, within_s=2)


@pytest.mark.timeout(120)
def test_a_request_of_one_token_is_answered_by_the_prefill_worker_alone(srv, stub):
    """Under auto, with the workers idle, a request whose whole answer is its first token runs
    whole on the prefill worker, by the cost model's choice or, asking for its prompt logprobs (a
    score), on the colocated path they fix: transformers' token and prompt logprobs, no KV
    moved, nothing on a decode worker, counted as a local prefill there. One that decodes goes
    to a decode worker, as before."""
    from tests.test_prompt_logprobs import check_prompt_logprobs

    set_policy(srv, Policy.AUTO)
    prompts = random_prompts([9, 33, 61], seed=523)
    before = received(srv)
    metric = srv.server.metrics.registry.get_sample_value
    labels = {"worker": "prefill-0", "role": "prefill", "kind": "local"}
    local_before = metric("pdserve_worker_prefills_total", labels) or 0.0
    for i, prompt in enumerate(prompts):
        sampling = pb.SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
        if i != 1:
            sampling.prompt_logprobs = 2
        req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
        msgs = list(stub.Generate(req, timeout=60))
        final = msgs[-1].final
        assert (final.path, final.prefill_worker, final.decode_worker) == (
            pb.PATH_COLOCATED, "", "prefill-0"
        ), final.decision_reason  # fmt: skip
        assert [t for m in msgs for t in m.token_ids] == hf_greedy(MODEL, prompt, 1)
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 1 and not final.kv_fallback
        first = next(m for m in msgs if m.token_ids)
        assert first.logprobs[0].token_id == first.token_ids[0]
        if i != 1:
            check_prompt_logprobs(prompt, first.prompt_logprobs, k=2)
        else:
            assert "prompt logprobs" not in final.decision_reason, final.decision_reason
    assert received(srv) == before  # no KV moved
    assert metric("pdserve_worker_prefills_total", labels) == local_before + len(prompts)
    toks, final = unary_tokens(stub, greedy(prompts[1]))
    assert toks == hf_greedy(MODEL, prompts[1], MAX_NEW)
    assert final.decode_worker in ("decode-0", "decode-1"), final.decision_reason


def test_health_serving_and_reflection_lists_the_service(srv):
    with grpc.insecure_channel(srv.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "pdserve.v1.Generation"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        names = {s.name for s in answers[0].list_services_response.service}
        assert "pdserve.v1.Generation" in names and "grpc.health.v1.Health" in names


def _bad(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    fields = {"prompt_token_ids": [1, 2, 3]}
    if {"prompt", "messages", "prompt_token_ids"} & kw.keys():
        fields = {}
    return pb.GenerateRequest(**fields, **kw, sampling=pb.SamplingParams(**sampling))


BAD_REQUESTS = {
    "empty prompt": (_bad(prompt_token_ids=[]), "prompt"),
    "unknown chat role": (
        _bad(messages=[pb.ChatMessage(role="wizard", content="hi")]),
        "messages[0].role",
    ),
    "max_tokens 0": (_bad(sampling={"max_tokens": 0}), "max_tokens"),
    "max_tokens past the context": (_bad(sampling={"max_tokens": 5000}), "max_tokens"),
    "negative temperature": (_bad(sampling={"temperature": -0.5}), "temperature"),
    "top_p 0": (_bad(sampling={"top_p": 0.0}), "top_p"),
    "token id outside the vocabulary": (_bad(prompt_token_ids=[1, 259, 2]), "prompt_token_ids"),
    "10 MB prompt": (_bad(prompt="a" * (10 << 20)), "prompt"),
    "presence_penalty 3": (_bad(sampling={"presence_penalty": 3.0}), "presence_penalty"),
    "repetition_penalty 0": (_bad(sampling={"repetition_penalty": 0.0}), "repetition_penalty"),
    "logit_bias past 100": (_bad(sampling={"logit_bias": {5: 200.0}}), "logit_bias"),
    "logit_bias outside the vocabulary": (_bad(sampling={"logit_bias": {259: 1.0}}), "logit_bias"),
    "prompt_logprobs 21": (_bad(sampling={"prompt_logprobs": 21}), "prompt_logprobs"),
    "prompt_logprobs on the disaggregated path": (
        _bad(sampling={"prompt_logprobs": 1}, path=pb.PATH_DISAGGREGATED),
        "prompt_logprobs",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_refused_naming_the_field(srv, stub, case):
    req, field = BAD_REQUESTS[case]
    for call in (stub.Complete, lambda r, timeout: list(stub.Generate(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:"), err.value.details()
    # The server keeps serving.
    toks, _ = unary_tokens(stub, greedy([5, 6, 7]))
    assert toks == hf_greedy(MODEL, [5, 6, 7], MAX_NEW)


def test_invalid_utf8_in_a_stop_string_is_refused_naming_the_field(srv):
    raw = greedy([1, 2, 3], stop=["ok", "XSTOPX"]).SerializeToString()
    raw = raw.replace(b"XSTOPX", b"X\xff\xfeOPX")
    with grpc.insecure_channel(srv.address) as channel:
        call = channel.unary_unary("/pdserve.v1.Generation/Complete")
        with pytest.raises(grpc.RpcError) as err:
            call(raw, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "sampling.stop[1]: is not valid UTF-8"


def test_full_queue_is_refused_at_once_with_a_retry_hint(srv, stub):
    core = srv.server.core
    saved = core.config
    core.config = replace(saved, max_pending=0)
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(greedy([1, 2, 3]), timeout=30)
        assert time.monotonic() - t0 < 1.0
    finally:
        core.config = saved
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    meta = dict(err.value.trailing_metadata())
    assert int(meta["retry-after-ms"]) >= 1 and meta["pdserve-reject-reason"] == "queue_full"
    assert_pools_full(srv)


def _long(path) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=random_prompts([40], seed=3)[0],
        sampling=pb.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True),
        path=path,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [pb.PATH_COLOCATED, pb.PATH_DISAGGREGATED])
def test_cancelled_stream_frees_its_blocks_on_every_worker_within_a_second(srv, stub, path):
    call = stub.Generate(_long(path), timeout=60)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            break
    call.cancel()
    assert_pools_full(srv, within_s=1.0)


@pytest.mark.timeout(60)
def test_deadline_aborts_the_request_everywhere(srv, stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_long(pb.PATH_DISAGGREGATED), timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_pools_full(srv, within_s=1.0)


def test_router_text_and_stop_strings_match_the_engine(srv, stub):
    """The router detokenizes itself; its text (stop strings cut out) equals the engine's."""
    from engine.config import CacheConfig, EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tests.helpers import loaded

    set_policy(srv, Policy.AUTO)
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=MODEL), cache=CacheConfig(block_size=4)),
        loaded(MODEL),
    )
    prompt = "the quick brown fox"
    plain = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    stop = plain.text[8:10]  # two characters from the middle of the greedy text
    want = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))[
        0
    ]
    assert want.stop_reason == stop and len(want.text) < len(plain.text)
    for path in (pb.PATH_COLOCATED, pb.PATH_DISAGGREGATED):
        req = pb.GenerateRequest(
            prompt=prompt,
            sampling=pb.SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]),
            path=path,
        )
        before = received(srv)
        msgs = list(stub.Generate(req, timeout=60))
        assert_handed_off(srv, before, [msgs[-1].final])
        assert "".join(m.text for m in msgs) == want.text
        assert [t for m in msgs for t in m.token_ids] == list(want.token_ids)
        final = msgs[-1].final
        assert final.finish_reason == pb.FINISH_REASON_STOP and final.stop_string == stop
    assert_pools_full(srv, within_s=2)


def test_two_requests_with_the_same_client_id_both_complete(srv, stub):
    prompts = random_prompts([12, 30], seed=5)
    reqs = [greedy(p) for p in prompts]
    for r in reqs:
        r.request_id = "same-id"
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda r: unary_tokens(stub, r), reqs))
    for p, (toks, final) in zip(prompts, outs):
        assert toks == hf_greedy(MODEL, p, MAX_NEW)
        assert final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert_pools_full(srv, within_s=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay_s", [0.0, 0.03, 0.1])
def test_cancel_during_reserve_prefill_or_transfer_frees_every_pool(srv, stub, delay_s):
    """A long prompt on the disaggregated path, cancelled before its first token: somewhere in
    reserve, prefill (32-token chunks over 900 tokens) or the KV transfer."""
    req = pb.GenerateRequest(
        prompt_token_ids=random_prompts([900], seed=int(delay_s * 1000) + 7)[0],
        sampling=pb.SamplingParams(max_tokens=50, temperature=0.0),
        path=pb.PATH_DISAGGREGATED,
    )
    call = stub.Generate(req, timeout=60)
    time.sleep(delay_s)
    call.cancel()
    assert_pools_full(srv, within_s=1.0)
