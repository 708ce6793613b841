"""A decode worker dies under a streaming request: the router resumes it on another decode
worker from its prompt and the tokens already streamed; greedy output is unchanged."""

from __future__ import annotations

import time

import grpc
import pytest
import ray

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.cluster import ClusterConfig
from tests.grpc_server import TINY_ENGINE, decoding, paced_steps, prefilling, tiny_server
from tests.helpers import hf_greedy, random_prompts
from tests.test_router_grpc import assert_pools_full

MODEL = "tiny-llama"
MAX_NEW = 600


@pytest.fixture(scope="module")
def srv():
    # Three decode workers: each case kills one and still leaves a choice.
    s = tiny_server(ClusterConfig(model=MODEL, num_prefill=1, num_decode=3, engine=TINY_ENGINE))
    yield s
    s.close()


@pytest.fixture(autouse=True)
def pools_full_after_each_test(srv):
    """After each test every live worker's pool is full and idle, and the router's books are
    empty."""
    yield
    assert_pools_full(srv, within_s=5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [pb.PATH_COLOCATED, pb.PATH_DISAGGREGATED])
def test_a_dead_decode_worker_s_request_resumes_on_another_token_for_token(srv, path):
    cluster = srv.server.cluster
    assert len(cluster.decode_ids) == 3
    metric = srv.server.metrics.registry.get_sample_value
    restarts = metric("pdserve_worker_restarts_total", {"role": "decode"})
    prompt = random_prompts([21], seed={1: 11, 2: 18}[path])[0]
    want = hf_greedy(MODEL, prompt, MAX_NEW)
    assert len(want) == MAX_NEW  # no EOS: the stream is long enough to kill mid-way
    rid = f"victim-{path}"
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        path=path,
    )
    got: list[int] = []
    killed = None
    final = None
    with grpc.insecure_channel(srv.address) as channel:
        for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=90):
            got.extend(msg.token_ids)
            if killed is None and len(got) >= 5:
                killed = decoding(srv, rid)
                assert killed is not None
                ray.kill(cluster.actor(killed), no_restart=True)
            if msg.HasField("final"):
                final = msg.final
    assert got == want
    assert final is not None and final.usage.completion_tokens == MAX_NEW
    assert killed in cluster.dead
    assert final.decode_worker != killed  # the survivor finished it
    # A new actor under the dead worker's id takes load again, and the metrics say so.
    deadline = time.monotonic() + 60
    while killed not in cluster.decode_ids:
        assert time.monotonic() < deadline, f"{killed} was not replaced within 60 s"
        time.sleep(0.1)
    # The survivors' pools are full again (nothing held, waiting for KV or in transfer); the
    # router's books are empty.
    assert_pools_full(srv, within_s=5)
    assert cluster.worker_info(killed).incarnation >= 1
    srv.run(srv.server.core.refresh())
    assert metric("pdserve_worker_restarts_total", {"role": "decode"}) == restarts + 1
    assert metric("pdserve_workers", {"role": "decode"}) == 3
    assert metric("pdserve_worker_failures_total", {"worker": killed, "role": "decode"}) >= 1


def stream(
    srv, rid: str, prompt: list[int], sampling: pb.SamplingParams, path: int, kill: bool
) -> tuple[list[int], pb.FinalInfo, str | None]:
    """One request's tokens, its final message, and the decode worker killed after its fifth
    token (where `kill`)."""
    cluster = srv.server.cluster
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                             path=path)  # fmt: skip
    got: list[int] = []
    final, killed = None, None
    with grpc.insecure_channel(srv.address) as channel:
        for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=90):
            got.extend(msg.token_ids)
            if kill and killed is None and len(got) >= 5:
                killed = decoding(srv, rid)
                assert killed is not None
                ray.kill(cluster.actor(killed), no_restart=True)
            if msg.HasField("final"):
                final = msg.final
    assert final is not None
    return got, final, killed


def handed_off_and_resumed(srv, rid: str, prompt: list[int], sampling: pb.SamplingParams):
    """The request prefilled on the prefill worker, its decode worker killed mid-stream, resumed
    on another (checked): its tokens. Waits for the killed worker's replacement."""
    cluster = srv.server.cluster
    resumed = srv.server.core.resumed
    before = srv.run(cluster.kv_stats())
    got, final, killed = stream(srv, rid, prompt, sampling, pb.PATH_DISAGGREGATED, kill=True)
    # Handed off first, and again once resumed (the path asked), on the prefill worker.
    assert final.path == pb.PATH_DISAGGREGATED and final.prefill_worker and final.resumed == 1
    # The resumed handoff moved its KV to the decode worker that finished it (a transfer
    # completed, bytes received), and nothing fell back to a local prefill.
    assert final.kv_fallback == "", final.kv_fallback
    after = srv.run(cluster.kv_stats())[final.decode_worker]
    was = before.get(final.decode_worker)
    assert after.ok > (was.ok if was else 0), (was, after)
    assert after.bytes_received > (was.bytes_received if was else 0), (was, after)
    assert killed in cluster.dead and final.decode_worker != killed
    assert srv.server.core.resumed == resumed + 1
    deadline = time.monotonic() + 60  # the module's workers as they were, for the next test
    while killed not in cluster.decode_ids:
        assert time.monotonic() < deadline, f"{killed} was not replaced within 60 s"
        time.sleep(0.1)
    return got


@pytest.mark.timeout(180)
def test_a_seeded_request_handed_off_then_resumed_gives_the_tokens_its_seed_gives(srv):
    """Sampled with a seed: prefilled on the prefill worker (its first sample there), decoded on
    a decode worker that is killed mid-stream, resumed on another: the tokens are those of the
    same request run colocated without a fault (each sample is drawn by its number)."""
    prompt = random_prompts([21], seed=27)[0]
    sampling = pb.SamplingParams(
        max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=4242, ignore_eos=True
    )
    want, _, _ = stream(srv, "seeded-whole", prompt, sampling, pb.PATH_COLOCATED, kill=False)
    assert len(want) == MAX_NEW and want != hf_greedy(MODEL, prompt, MAX_NEW)  # sampled
    assert handed_off_and_resumed(srv, "seeded-victim", prompt, sampling) == want


@pytest.mark.timeout(240)
def test_penalized_requests_handed_off_then_resumed_give_the_tokens_of_no_fault(srv):
    """Greedy with a repetition penalty, handed off, its decode worker killed mid-stream and
    resumed: transformers' tokens with that penalty (the prompt and the whole output penalized
    on every worker). With presence and frequency penalties: the tokens of the same request run
    colocated without a fault (the output before the resume still counts)."""
    prompt = random_prompts([21], seed=29)[0]
    rep = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.3)
    want = hf_greedy(MODEL, prompt, MAX_NEW, repetition_penalty=1.3)
    assert len(want) > 20 and want != hf_greedy(MODEL, prompt, MAX_NEW)  # long enough to cut
    assert handed_off_and_resumed(srv, "repetition-victim", prompt, rep) == want
    both = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, presence_penalty=0.4,
                             frequency_penalty=0.05, ignore_eos=True)  # fmt: skip
    want, _, _ = stream(srv, "penalized-whole", prompt, both, pb.PATH_COLOCATED, kill=False)
    assert want != hf_greedy(MODEL, prompt, MAX_NEW)
    assert handed_off_and_resumed(srv, "penalized-victim", prompt, both) == want


@pytest.mark.timeout(120)
def test_a_worker_whose_engine_step_fails_is_replaced_and_its_request_resumes(srv):
    def break_engine_step(worker) -> None:
        """(Runs inside the worker's actor; defined here so that it travels by value.)"""

        def boom(*args, **kwargs):
            raise RuntimeError("injected step failure")

        worker.engine.step = boom

    cluster = srv.server.cluster
    prompt = random_prompts([21], seed=11)[0]
    want = hf_greedy(MODEL, prompt, MAX_NEW)
    req = pb.GenerateRequest(
        request_id="broken-engine",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        path=pb.PATH_COLOCATED,
    )
    got: list[int] = []
    broken = None
    with grpc.insecure_channel(srv.address) as channel:
        for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=90):
            got.extend(msg.token_ids)
            if broken is None and len(got) >= 5:
                broken = decoding(srv, "broken-engine")
                assert broken is not None
                old = cluster.worker_info(broken)
                inject = cluster.actor(broken).__ray_call__.remote(break_engine_step)
                try:
                    ray.get(inject, timeout=30)
                except ray.exceptions.RayActorError:
                    # Its engine thread took the broken step and ended the
                    # process before this call's reply left: the fault struck.
                    pass
            if msg.HasField("final"):
                assert msg.final.decode_worker != broken  # finished elsewhere
    assert got == want  # resumed token for token, not failed
    # The worker ended its process; a new one under the same id takes load again.
    deadline = time.monotonic() + 60
    while broken not in cluster.decode_ids or cluster.worker_info(broken).pid == old.pid:
        assert time.monotonic() < deadline, f"{broken} was not replaced within 60 s"
        time.sleep(0.1)
    assert cluster.worker_info(broken).incarnation > old.incarnation


@pytest.mark.timeout(120)
def test_a_one_token_request_on_a_prefill_worker_that_dies_is_answered_by_another(srv):
    """A request of one token (with its prompt logprobs) is placed whole on the prefill worker;
    that worker is killed once the router's books hold it there (its steps paced at 2 s, so
    none it started has ended): the request resumes on a decode worker with transformers'
    token and prompt logprobs, and the prefill worker is replaced."""
    from tests.test_prompt_logprobs import check_prompt_logprobs

    cluster = srv.server.cluster
    prompt = random_prompts([70], seed=613)[0]  # three steps of 32 tokens
    rid = "one-token-victim"
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
    )
    victim = cluster.actor("prefill-0")
    old = cluster.worker_info("prefill-0")

    with paced_steps([victim], 2.0), grpc.insecure_channel(srv.address) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(req, timeout=90)
        deadline = time.monotonic() + 30
        while prefilling(srv, rid) != "prefill-0":
            assert time.monotonic() < deadline, "never placed on prefill-0"
            time.sleep(0.05)
        ray.kill(victim, no_restart=True)
        msgs = list(call)
    final = msgs[-1].final
    assert final.resumed == 1 and final.decode_worker.startswith("decode-"), final
    assert [t for m in msgs for t in m.token_ids] == hf_greedy(MODEL, prompt, 1)
    check_prompt_logprobs(prompt, next(m for m in msgs if m.token_ids).prompt_logprobs, k=1)
    deadline = time.monotonic() + 60
    while "prefill-0" not in cluster.prefill_ids or cluster.worker_info("prefill-0").pid == old.pid:
        assert time.monotonic() < deadline, "prefill-0 was not replaced within 60 s"
        time.sleep(0.1)
    assert cluster.worker_info("prefill-0").incarnation > old.incarnation
