"""A worker hangs (its process stopped, SIGSTOP: no step, no answer, and nothing Ray itself
notices). The router's load poll goes on without it; its watchdog takes it for hung after
--worker-hang-timeout, stops it and replaces it:
  - a decode worker's stream resumes on the other decode worker, token for token;
  - a prefill worker's handoff is prefilled on its decode worker, token for token."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.cluster import ClusterConfig
from tests.grpc_server import TINY_ENGINE, decoding, tiny_server
from tests.helpers import hf_greedy, random_prompts
from tests.test_router_grpc import assert_pools_full

MODEL = "tiny-llama"
MAX_NEW = 400
# Silent (no new requests) from half of it, hung at it: the test watches for the silent phase
# once a 2 s poll has come back, which a loaded host can stretch past 3 s, so the phase is 4 s.
HANG_S = 8.0


@pytest.fixture(scope="module")
def srv():
    s = tiny_server(
        ClusterConfig(model=MODEL, num_prefill=1, num_decode=2, engine=TINY_ENGINE,
                      worker_hang_timeout_s=HANG_S)
    )  # fmt: skip
    yield s
    s.close()


async def silent(cluster) -> set[str]:
    return cluster.silent  # read on the server's loop, which polls


def replaced(srv, worker: str) -> None:
    """Wait until a new incarnation of `worker` takes load."""
    cluster = srv.server.cluster
    deadline = time.monotonic() + 90
    while worker not in cluster.prefill_ids + cluster.decode_ids:
        assert time.monotonic() < deadline, f"{worker} was not replaced within 90 s"
        time.sleep(0.1)
    assert cluster.worker_info(worker).incarnation == 1


def end(pid: int) -> None:
    """Ray's kill cannot end a stopped process: it ends here."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(240)
def test_a_hung_decode_worker_is_stopped_and_replaced_and_its_stream_resumes(srv, ledger):
    cluster = srv.server.cluster
    metric = srv.server.metrics.registry.get_sample_value
    resumed = metric("pdserve_requests_resumed_total") or 0
    prompt = random_prompts([23], seed=171)[0]
    want = hf_greedy(MODEL, prompt, MAX_NEW)
    assert len(want) == MAX_NEW  # no EOS: the stream runs long enough to stop its worker
    req = pb.GenerateRequest(
        request_id="hung",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        path=pb.PATH_COLOCATED,
    )
    got: list[int] = []
    stopped = final = None
    pid = 0
    try:
        with grpc.insecure_channel(srv.address) as channel:
            # Without the watchdog the stream would wait for its deadline: nothing else ends it.
            for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=90):
                got.extend(msg.token_ids)
                if stopped is None and len(got) >= 5:
                    stopped = decoding(srv, "hung")
                    assert stopped is not None
                    other = next(w for w in cluster.decode_ids if w != stopped)
                    pid = cluster.worker_info(stopped).pid
                    os.kill(pid, signal.SIGSTOP)
                    at = len(got)
                    # A poll meanwhile comes back at once with every other worker's figures:
                    # the stopped one holds up no one.
                    t0 = time.monotonic()
                    loads = srv.run(cluster.load(2.0))
                    assert time.monotonic() - t0 < 5.0
                    rest = {*cluster.prefill_ids, *cluster.decode_ids} - {stopped}
                    assert {ld.worker_id for ld in loads} == rest, loads
                    # Silent for half the hang timeout, it takes no new request before it is
                    # taken for hung (tests/test_router_core.py: the placement).
                    while (quiet := srv.run(silent(cluster))) != {stopped}:
                        assert time.monotonic() - t0 < HANG_S, quiet
                        time.sleep(0.05)
                    assert stopped in cluster.decode_ids
                if msg.HasField("final"):
                    final = msg.final
        ledger.add(injected=1, sent=1, completed=1)
        assert got == want
        assert at < MAX_NEW - 50  # stopped mid-stream, with most of it still to come
        assert final is not None and final.decode_worker == other
        assert cluster.hung == [stopped] and stopped in cluster.dead
        replaced(srv, stopped)  # a new incarnation under its id takes load
        srv.run(srv.server.core.refresh())
        labels = {"worker": stopped, "role": "decode"}
        assert metric("pdserve_worker_hangs_total", labels) == 1
        assert metric("pdserve_worker_failures_total", labels) == 1
        assert metric("pdserve_worker_hangs_total", {"worker": other, "role": "decode"}) == 0
        assert metric("pdserve_requests_resumed_total") == resumed + 1
        assert len(cluster.pools.live()) == 3  # the replacement among them
        assert_pools_full(srv, within_s=10)
    finally:
        if pid:
            end(pid)


@pytest.mark.timeout(240)
def test_a_hung_prefill_worker_is_stopped_and_its_handoff_prefilled_on_its_decode_worker(
    srv, ledger
):
    cluster = srv.server.cluster
    metric = srv.server.metrics.registry.get_sample_value
    [victim] = cluster.prefill_ids
    hung = list(cluster.hung)
    prompt = random_prompts([31], seed=172)[0]
    want = hf_greedy(MODEL, prompt, 12)
    pid = cluster.worker_info(victim).pid
    os.kill(pid, signal.SIGSTOP)  # before the request: its prefill waits there
    try:
        req = pb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=12, temperature=0.0),
            path=pb.PATH_DISAGGREGATED,
        )
        with grpc.insecure_channel(srv.address) as channel:
            msgs = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=60))
        ledger.add(injected=1, sent=1, completed=1)
        assert [t for m in msgs for t in m.token_ids] == want
        final = msgs[-1].final
        assert final.prefill_worker == victim  # placed there, and hung there
        assert final.kv_fallback == "prefill_failed", final
        assert cluster.hung == [*hung, victim]
        replaced(srv, victim)
        srv.run(srv.server.core.refresh())
        labels = {"worker": victim, "role": "prefill"}
        assert metric("pdserve_worker_hangs_total", labels) == 1
        assert metric("pdserve_local_prefill_fallbacks_total", {"reason": "prefill_failed"}) == 1
        assert len(cluster.pools.live()) == 3  # the replacement among them
        assert_pools_full(srv, within_s=10)
    finally:
        end(pid)
