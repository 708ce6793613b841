"""--kv-failure-policy: a disaggregated request whose KV does not come is prefilled on its decode
worker (recompute, the default) or ends with UNAVAILABLE and the reason (fail). Either way it is
counted as a fallback with its reason, and its blocks are freed on both workers."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.errors import HandoffFailed
from router.vocab import FallbackReason, Placement, RoutePath
from tests.helpers import random_prompts


def wait_full(actor, timeout=15.0):
    end = time.monotonic() + timeout
    while True:
        load = ray.get(actor.load.remote())
        idle = load.running == load.waiting == load.waiting_for_kv == load.held == 0
        if load.num_free_blocks == load.num_blocks and idle and not load.open_transfers:
            return
        assert time.monotonic() < end, f"pool not full after {timeout} s: {load}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_fail_policy_ends_the_request_with_the_reason_and_frees_both_pools():
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
    )
    c = Cluster(
        ClusterConfig(
            model="tiny-llama", engine=engine, kv_transfer_deadline_s=5,
            kv_failure_policy="fail",
        )
    )  # fmt: skip
    try:
        d, p = c.actor("decode-0"), c.actor("prefill-0")
        sp = SamplingParams(max_tokens=4, temperature=0.0)

        async def run(prompt, rid):
            placement = Placement(path=RoutePath.DISAGGREGATED, request_id=rid)
            return [t async for ch in c.generate(prompt, sp, placement) for t in ch.token_ids]

        prompts = random_prompts([28, 33], seed=141)
        assert len(asyncio.run(run(prompts[0], "fine"))) == 4  # the handoff works
        ray.get(d.disconnect.remote("prefill-0"))  # the pair breaks at the decode end
        with pytest.raises(HandoffFailed) as err:
            asyncio.run(run(prompts[1], "doomed"))
        assert err.value.reason == "transfer_failed"
        assert [(rid, why) for rid, why, _ in c.fallbacks] == [
            ("doomed", FallbackReason.TRANSFER_FAILED)
        ]
        wait_full(d)  # the reservation and the receive are gone
        wait_full(p)  # the prefill's held blocks too
    finally:
        c.shutdown()


def test_an_unknown_policy_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="kv_failure_policy: must be one of recompute, fail"):
        ClusterConfig(kv_failure_policy="retry")


@pytest.mark.timeout(60)
def test_the_client_gets_unavailable_with_the_reason_and_the_fallback_is_counted():
    import grpc

    from engine.config import ModelConfig
    from engine.loader import load_tokenizer
    from pdserve_proto import generation_pb2 as pb
    from pdserve_proto import generation_pb2_grpc as pb_grpc
    from router.fake_backend import FakeBackend
    from router.serve_config import ServeConfig
    from tests.grpc_server import ServerThread

    backend = FakeBackend(fallback=FallbackReason.PAIRING_FAILED, fail_handoffs=True)
    s = ServerThread(
        ServeConfig(port=0, metrics_port=0), backend=backend,
        tokenizer=load_tokenizer(ModelConfig(model="tiny-llama")),
    )  # fmt: skip
    try:
        req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], path=pb.PATH_DISAGGREGATED)
        with grpc.insecure_channel(s.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.GenerationStub(ch).Complete(req, timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "KV handoff failed (pairing_failed)" in err.value.details()
        sample = s.server.metrics.registry.get_sample_value
        assert sample("pdserve_local_prefill_fallbacks_total", {"reason": "pairing_failed"}) == 1
        assert (
            sample(
                "pdserve_requests_total",
                {"path": "disaggregated", "finish_reason": "error", "frontend": "grpc"},
            )
            == 1
        )
        assert s.server.core.pending == s.server.core.active == 0
    finally:
        s.close()
