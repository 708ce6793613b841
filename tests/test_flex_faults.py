"""A worker that does both dies under a request it decodes: the router resumes the request on
the other one from its prompt and the tokens already streamed, token for token; the dead worker
is replaced and every pool is full again (2 workers of both kinds, nothing else; tiny model)."""

from __future__ import annotations

import time

import grpc
import pytest
import ray

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.cluster import ClusterConfig
from tests.grpc_server import TINY_ENGINE, decoding, tiny_server
from tests.helpers import hf_greedy, random_prompts
from tests.test_router_grpc import assert_pools_full

MODEL = "tiny-llama"
MAX_NEW = 600


@pytest.fixture(scope="module")
def srv():
    s = tiny_server(
        ClusterConfig(model=MODEL, num_prefill=0, num_decode=0, num_both=2, engine=TINY_ENGINE)
    )
    yield s
    s.close()


@pytest.mark.timeout(150)
def test_a_dead_decoding_worker_of_both_kinds_resumes_its_handoff_on_the_other(srv):
    cluster = srv.server.cluster
    assert sorted(cluster.decode_ids) == ["both-0", "both-1"]
    metric = srv.server.metrics.registry.get_sample_value
    restarts = metric("pdserve_worker_restarts_total", {"role": "both"}) or 0.0
    prompt = random_prompts([23], seed=11)[0]
    want = hf_greedy(MODEL, prompt, MAX_NEW)
    assert len(want) == MAX_NEW  # no EOS: the stream is long enough to kill mid-way
    req = pb.GenerateRequest(
        request_id="flex-victim",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        path=pb.PATH_DISAGGREGATED,  # prefilled on one, decoded on the other
    )
    sent_before = srv.run(cluster.kv_stats())
    got: list[int] = []
    killed = old = final = None
    with grpc.insecure_channel(srv.address) as channel:
        for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=120):
            got.extend(msg.token_ids)
            if killed is None and len(got) >= 5:
                killed = decoding(srv, "flex-victim")
                assert killed is not None
                old = cluster.worker_info(killed)
                ray.kill(cluster.actor(killed), no_restart=True)
            if msg.HasField("final"):
                final = msg.final
    assert got == want  # resumed token for token
    assert final is not None and final.usage.completion_tokens == MAX_NEW
    assert final.decode_worker != killed  # the survivor, which had prefilled it, finished it
    # The answer names the placement that finished it, colocated on the survivor, and the move
    # (it said "disaggregated", prefilled and decoded on the survivor).
    assert (final.resumed, final.path, final.prefill_worker) == (1, pb.PATH_COLOCATED, "")
    # The dead worker comes back under its id, as a worker of both kinds, and is counted so.
    deadline = time.monotonic() + 90
    while killed not in cluster.decode_ids or cluster.worker_info(killed).pid == old.pid:
        assert time.monotonic() < deadline, f"{killed} was not replaced within 90 s"
        time.sleep(0.2)
    assert killed in cluster.prefill_ids
    # The first placement really was a handoff between the two: the survivor sent KV.
    survivor = final.decode_worker
    assert srv.run(cluster.kv_stats())[survivor].bytes_sent > sent_before[survivor].bytes_sent
    srv.run(srv.server.core.refresh())
    assert metric("pdserve_worker_restarts_total", {"role": "both"}) == restarts + 1
    # Every pool is full and the router's books are empty.
    assert_pools_full(srv, within_s=10)
