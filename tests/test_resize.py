"""Live resize through the admin service, under steady load: 1+1 -> 2+2 -> 1+1 workers, with
requests on both paths streaming all along. No request fails; every output equals transformers'
greedy one; the added workers take requests; the removed ones stop; the pools end full."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import grpc
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve_proto import admin_pb2, admin_pb2_grpc
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.cluster import ClusterConfig
from router.serve_config import ServeConfig
from tests.grpc_server import ServerThread, paced_steps
from tests.helpers import hf_greedy, random_prompts
from tests.test_router_grpc import assert_pools_full

MODEL = "tiny-llama"
MAX_NEW = 40
PROMPTS = random_prompts([12, 30, 47, 21, 64, 9], seed=131)


@pytest.fixture(scope="module")
def srv():
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
    )
    config = ServeConfig(
        cluster=ClusterConfig(
            model=MODEL, num_prefill=1, num_decode=1, engine=engine, kv_transfer_deadline_s=10
        ),
        port=0,
        metrics_port=None,
        admin_port=0,
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


class Load:
    """Clients sending requests back to back, alternating paths, until stopped; every answer and
    every failure is kept."""

    def __init__(self, address: str, clients: int = 3) -> None:
        self.address = address
        self.stop = threading.Event()
        self.done: list[tuple[int, list[int], pb.FinalInfo]] = []
        self.failed: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, client: int) -> None:
        n = 0
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while not self.stop.is_set():
                k = (client + 3 * n) % len(PROMPTS)
                path = pb.PATH_DISAGGREGATED if n % 2 == 0 else pb.PATH_COLOCATED
                n += 1
                req = pb.GenerateRequest(
                    prompt_token_ids=PROMPTS[k],
                    sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
                    path=path,
                )
                try:
                    toks: list[int] = []
                    final = None
                    for msg in stub.Generate(req, timeout=120):
                        toks.extend(msg.token_ids)
                        if msg.HasField("final"):
                            final = msg.final
                    assert final is not None
                    self.done.append((k, toks, final))
                except grpc.RpcError as exc:
                    self.failed.append(f"{exc.code().name}: {exc.details()}")

    def wait_for(self, pred, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert not self.failed, self.failed
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(150)


def listed(srv) -> list[admin_pb2.Worker]:
    with grpc.insecure_channel(f"127.0.0.1:{srv.server.admin_port}") as ch:
        res = admin_pb2_grpc.AdminStub(ch).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
    return list(res.workers)


@pytest.mark.timeout(300)
def test_scale_up_and_down_under_load_fails_no_request(srv):
    want = {k: hf_greedy(MODEL, p, MAX_NEW) for k, p in enumerate(PROMPTS)}
    cluster = srv.server.cluster
    load = Load(srv.address)
    try:
        load.wait_for(lambda: len(load.done) >= 6, 60)
        # Up to 2+2 through the admin service; it answers once the new workers take load.
        with grpc.insecure_channel(f"127.0.0.1:{srv.server.admin_port}") as ch:
            res = admin_pb2_grpc.AdminStub(ch).Scale(
                admin_pb2.ScaleRequest(prefill=2, decode=2), timeout=200
            )
        ready = sorted(w.worker_id for w in res.workers if w.status == "ready")
        assert ready == ["decode-0", "decode-1", "prefill-0", "prefill-1"], res.workers
        assert cluster.prefill_ids == ["prefill-0", "prefill-1"]
        assert cluster.decode_ids == ["decode-0", "decode-1"]
        mark = len(load.done)
        load.wait_for(
            lambda: (
                {"decode-1"} <= {f.decode_worker for _, _, f in load.done[mark:]}
                and {"prefill-1"} <= {f.prefill_worker for _, _, f in load.done[mark:]}
            ),
            90,
        )
        # Down to 1+1 with the command an operator types; a short drain, so that a request
        # still running on a removed worker resumes elsewhere.
        out = subprocess.run(
            [sys.executable, "-m", "router.cli", "scale", "--address",
             f"127.0.0.1:{srv.server.admin_port}", "--prefill", "1", "--decode", "1",
             "--drain-timeout", "1"],
            capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert len(cluster.prefill_ids) == 1 and len(cluster.decode_ids) == 1
        workers = listed(srv)
        assert len(workers) == 2 and all(w.status == "ready" for w in workers), workers
        mark = len(load.done)
        load.wait_for(lambda: len(load.done) >= mark + 6, 90)
    finally:
        load.close()
    assert not load.failed, load.failed
    for k, toks, final in load.done:
        assert toks == want[k], (k, final)
        # Added workers took load only once paired: no handoff fell back, before or after.
        assert final.kv_fallback == "", final
    survivors = {*cluster.prefill_ids, *cluster.decode_ids}
    assert {f.decode_worker for _, _, f in load.done[mark:]} <= survivors
    # Nothing left behind on the survivors (no block, hold, wait for KV or open transfer); the
    # router's books are empty.
    assert_pools_full(srv, within_s=10)


@pytest.mark.timeout(300)
def test_requests_left_on_a_removed_worker_after_its_drain_resume_elsewhere(srv):
    cluster = srv.server.cluster
    admin = f"127.0.0.1:{srv.server.admin_port}"
    with grpc.insecure_channel(admin) as ch:
        admin_pb2_grpc.AdminStub(ch).Scale(admin_pb2.ScaleRequest(decode=2), timeout=200)
    assert len(cluster.decode_ids) == 2
    prompts = random_prompts([19, 26], seed=133)
    long_new = 600  # paced below: 3 s at least, six times the drain
    wants = [hf_greedy(MODEL, p, long_new) for p in prompts]
    assert [len(w) for w in wants] == [long_new] * 2  # no EOS on the way
    got: list[list[int]] = [[], []]
    finals: list[pb.FinalInfo | None] = [None, None]
    errors: list[str] = []

    def stream(i: int) -> None:
        req = pb.GenerateRequest(
            prompt_token_ids=prompts[i],
            sampling=pb.SamplingParams(max_tokens=long_new, temperature=0.0),
            path=pb.PATH_COLOCATED,
        )
        try:
            with grpc.insecure_channel(srv.address) as ch:
                for msg in pb_grpc.GenerationStub(ch).Generate(req, timeout=120):
                    got[i].extend(msg.token_ids)
                    if msg.HasField("final"):
                        finals[i] = msg.final
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    with paced_steps([cluster.actor(w) for w in cluster.decode_ids], 0.005):
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while min(len(g) for g in got) < 5:  # both are decoding, one on each worker
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.05)
        on = {w: cluster.pools.workers[w].active for w in cluster.decode_ids}
        assert sorted(on.values()) == [1, 1], on  # one on each decode worker
        resumed_before = srv.server.core.resumed
        with grpc.insecure_channel(admin) as ch:
            admin_pb2_grpc.AdminStub(ch).Scale(
                admin_pb2.ScaleRequest(decode=1, drain_timeout_s=0.5), timeout=200
            )
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert got == wants
    (survivor,) = cluster.decode_ids
    assert all(f is not None and f.decode_worker == survivor for f in finals), finals
    assert srv.server.core.resumed == resumed_before + 1  # the one on the removed worker


@pytest.mark.timeout(300)
def test_a_scale_whose_caller_gives_up_still_completes(srv, capsys, caplog):
    """...and the log says when it is done (it was said by the caller's handler, cancelled)."""
    from router.cli import main

    caplog.set_level(logging.INFO, "pdserve.admin")
    cluster = srv.server.cluster
    admin = f"127.0.0.1:{srv.server.admin_port}"
    before = len(cluster.prefill_ids)
    argv = ["scale", "--address", admin, "--prefill", str(before + 1), "--timeout", "0.3"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "DEADLINE_EXCEEDED" in err and "after 0.3 s; the resize goes on in the server" in err
    deadline = time.monotonic() + 120
    while len(cluster.prefill_ids) != before + 1:  # the new worker comes up anyway
        assert time.monotonic() < deadline, listed(srv)
        time.sleep(0.1)
    assert all(w.status == "ready" for w in listed(srv))
    asked = f"prefill {before + 1}"
    while not any(r.getMessage() == f"scale done: {asked}" for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    # `pdserve workers` tells the caller who gave up how it ended.
    assert main(["workers", "--address", admin]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("last scale:")]
    assert line.startswith(f"last scale: {asked}: done in "), line
    # And a resize after it sees the pools as they are: back to the size before.
    with grpc.insecure_channel(admin) as ch:
        admin_pb2_grpc.AdminStub(ch).Scale(admin_pb2.ScaleRequest(prefill=before), timeout=200)
    assert len(cluster.prefill_ids) == before
    assert sorted(w.role for w in listed(srv)).count("prefill") == before


@pytest.mark.timeout(60)
def test_bad_sizes_are_refused_naming_the_field(srv, caplog):
    caplog.set_level(logging.INFO, "pdserve.admin")
    admin = f"127.0.0.1:{srv.server.admin_port}"
    with grpc.insecure_channel(admin) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        for req, field in (
            (admin_pb2.ScaleRequest(decode=0), "decode"),
            (admin_pb2.ScaleRequest(prefill=-1), "prefill"),
            (admin_pb2.ScaleRequest(decode=1, drain_timeout_s=-1), "drain_timeout_s"),
            # No end to a drain: it would hold every later resize.
            (admin_pb2.ScaleRequest(decode=1, drain_timeout_s=float("inf")), "drain_timeout_s"),
            (admin_pb2.ScaleRequest(decode=1, drain_timeout_s=float("nan")), "drain_timeout_s"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Scale(req, timeout=10)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}: ")
    # The log says it was refused, and why (a check past the request's own fields).
    said = [r.getMessage() for r in caplog.records if r.name == "pdserve.admin"]
    assert any(m.startswith("scale refused: decode: need at least 1 worker") for m in said), said
    assert not any(m.startswith("scale done") for m in said), said
    # ListWorkers says so too (the fields' own refusals never reach a resize).
    with grpc.insecure_channel(admin) as ch:
        res = admin_pb2_grpc.AdminStub(ch).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
    last = res.last_scale
    assert (last.asked, last.outcome) == ("decode 0", "refused"), last
    assert last.detail.startswith("decode: need at least 1 worker") and last.ended_unix, last
    # The server still serves.
    with grpc.insecure_channel(srv.address) as ch:
        res = pb_grpc.GenerationStub(ch).Complete(
            pb.GenerateRequest(prompt_token_ids=PROMPTS[0],
                               sampling=pb.SamplingParams(max_tokens=3, temperature=0.0)),
            timeout=60,
        )  # fmt: skip
    assert len(res.token_ids) == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caller_waits", [True, False])
def test_a_resize_whose_worker_waits_for_room_is_replaced_by_the_next(srv, caplog, caller_waits):
    """A prefill worker asking for a resource no node has waits for room (up to the start
    deadline, 300 s): the next resize does not wait behind it; the first is told it was
    replaced (or, its caller gone, the log says so), and its waiting actor is stopped."""
    from router.workers import Placement, WorkerStatus
    from worker_protocol.messages import WorkerRole

    caplog.set_level(logging.INFO, "pdserve.admin")
    pools = srv.server.cluster.pools
    before = len(srv.server.cluster.prefill_ids)
    assert pools.config.start_timeout_s > 120  # the first would otherwise end on its own
    placement = pools.config.placement.get(WorkerRole.PREFILL, Placement())
    pools.config.placement[WorkerRole.PREFILL] = Placement(0.0, (("pdserve_test_nowhere", 1.0),))
    admin = f"127.0.0.1:{srv.server.admin_port}"
    errors: list[grpc.RpcError] = []

    def first() -> None:
        with grpc.insecure_channel(admin) as ch:
            try:
                admin_pb2_grpc.AdminStub(ch).Scale(
                    admin_pb2.ScaleRequest(prefill=before + 1), timeout=100 if caller_waits else 1
                )
            except grpc.RpcError as exc:
                errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not any(h.status is WorkerStatus.STARTING for h in pools.handles()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (waiting,) = [h for h in pools.handles() if h.status is WorkerStatus.STARTING]
        assert waiting.node_id is None  # no node had room for it
    finally:
        pools.config.placement[WorkerRole.PREFILL] = placement
    if not caller_waits:
        t.join(30)  # its deadline passed: its handler is gone, the resize goes on
    with grpc.insecure_channel(admin) as ch:
        admin_pb2_grpc.AdminStub(ch).Scale(admin_pb2.ScaleRequest(prefill=before), timeout=60)
    t.join(30)
    assert not t.is_alive()
    (err,) = errors
    if caller_waits:
        assert err.code() is grpc.StatusCode.ABORTED, err
        assert "a later resize replaced this one" in err.details()
    else:  # gone before the second resize
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert waiting.status is WorkerStatus.STOPPED
    assert sorted(w.role for w in listed(srv)).count("prefill") == before
    assert all(w.status == "ready" for w in listed(srv))
    deadline = time.monotonic() + 30  # the first resize's own task says it
    while not any(r.getMessage().startswith("scale replaced: prefill") for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
