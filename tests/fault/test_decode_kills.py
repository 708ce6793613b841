"""Ten decode-worker kills under a steady load of concurrent streams, through the router: every
stream completes with transformers' greedy output (a stream on a killed worker resumes on another
from its prompt and the tokens already sent), each killed worker is replaced, nothing is lost."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.cluster import ClusterConfig
from router.serve_config import ServeConfig
from tests.grpc_server import ServerThread
from tests.helpers import hf_greedy, random_prompts
from tests.test_router_grpc import assert_pools_full
from worker_protocol.messages import WorkerRole

MODEL = "tiny-llama"
MAX_NEW = 80
KILLS = 10
PROMPTS = random_prompts([14, 27, 33, 19, 41, 22], seed=161)


def holder(srv) -> str | None:
    """A decode worker that the router's books say holds a stream now."""
    for w in srv.server.cluster.decode_ids:
        state = srv.server.core.states.get(w)
        if state is not None and state.batch > 0:
            return w
    return None


def unseen(srv, victim: str, incarnation: int) -> bool:
    """Not yet: the killed incarnation of `victim` is still taking load, as the router sees it."""
    h = srv.server.cluster.pools.workers[victim]
    return h.incarnation == incarnation and victim in srv.server.cluster.decode_ids


def pools(srv) -> list[tuple[str, str, int, str]]:
    return [
        (h.worker_id, h.status.value, h.incarnation, h.error)
        for h in srv.server.cluster.pools.handles()
    ]


@pytest.mark.timeout(600)
def test_ten_decode_worker_kills_under_load_lose_nothing(ledger):
    want = {k: hf_greedy(MODEL, p, MAX_NEW) for k, p in enumerate(PROMPTS)}
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
    )
    srv = ServerThread(
        ServeConfig(
            cluster=ClusterConfig(model=MODEL, num_prefill=1, num_decode=3, engine=engine),
            port=0, metrics_port=0, drain_timeout_s=5,
        )
    )  # fmt: skip
    stop = threading.Event()
    done: list[tuple[int, list[int]]] = []
    failed: list[str] = []
    sent = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while not stop.is_set():
                k = (i + n) % len(PROMPTS)
                path = pb.PATH_DISAGGREGATED if (i + n) % 2 else pb.PATH_COLOCATED
                n += 1
                req = pb.GenerateRequest(
                    prompt_token_ids=PROMPTS[k],
                    sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
                    path=path,
                )
                with lock:
                    sent[0] += 1
                try:
                    toks = [t for m in stub.Generate(req, timeout=120) for t in m.token_ids]
                    with lock:
                        done.append((k, toks))
                except grpc.RpcError as exc:
                    with lock:
                        failed.append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    cluster = srv.server.cluster
    resumed0 = srv.server.core.resumed
    try:
        try:
            for t in threads:
                t.start()
            for _ in range(KILLS):
                deadline = time.monotonic() + 30
                while (victim := holder(srv)) is None:  # strike a worker that holds a stream
                    assert time.monotonic() < deadline, "no stream to strike"
                    time.sleep(0.01)
                incarnation = cluster.pools.workers[victim].incarnation
                os.kill(cluster.worker_info(victim).pid, signal.SIGKILL)
                # The next kill waits until the router has seen this one and it was replaced (a
                # stream outlives at most two dead workers: strikes in a row could kill a third).
                deadline = time.monotonic() + 180
                while unseen(srv, victim, incarnation) or len(cluster.decode_ids) < 3:
                    assert time.monotonic() < deadline, f"{victim} was not replaced: {pools(srv)}"
                    time.sleep(0.05)
            deadline = time.monotonic() + 120
            while len(cluster.decode_ids) < 3:  # every one replaced in the end
                assert time.monotonic() < deadline, f"not every one was replaced: {pools(srv)}"
                time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join(150)
            lost = sent[0] - len(done) - len(failed)
            ledger.add(injected=KILLS, sent=sent[0], completed=len(done), failed=len(failed))
            resumed = srv.server.core.resumed - resumed0
            restarts = cluster.restarts[WorkerRole.DECODE]
        # Every block the killed and surviving workers allocated is free again, and nothing is
        # left waiting for KV or holding a transfer open.
        assert_pools_full(srv, within_s=15)
    finally:
        srv.close()
    assert not failed, failed
    assert lost == 0
    assert all(toks == want[k] for k, toks in done)
    assert restarts == KILLS
    assert resumed >= KILLS // 2, resumed  # streams were struck, not only idle workers
