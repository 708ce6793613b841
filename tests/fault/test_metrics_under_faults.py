"""Metrics under failure, read by a real Prometheus (the repository's prometheus.yml and
alerts.yml, every alert's `for` shortened to 0 s): corrupted transfers, a flood past admission and
a decode worker killed under streams. Afterwards the failure, fallback, rejection, resume and
worker-failure counters have moved by exactly what was injected (as the clients saw it), the
matching alerts fire, every alert's expression selects real series, and the pools are full."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kv_transfer.faults import FaultKind, FaultPlan
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router import status
from router.cluster import ClusterConfig
from router.core_types import RouterConfig
from router.serve_config import ServeConfig
from tests.fault.clusters import pools_full
from tests.grpc_server import ServerThread
from tests.helpers import random_prompts
from tests.prometheus_server import alerts, api, prometheus, rules

FLOOD = 80  # requests sent at once past a queue of 2: well over 30 refused, so that the
# rejection alert's rate over 5 minutes passes 0.1/s
STREAMS = 4
LONG = 300


def request(prompt: list[int], path: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        path=path,
    )


def counters(srv: ServerThread, name: str, key: str) -> dict[str, float]:
    samples = status.scrape(f"127.0.0.1:{srv.server.metrics_port}")
    return {k[0]: v for k, v in status.by_labels(samples, name, key).items()}


def rule_health(port: int) -> list[tuple[str, str, str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=10) as resp:
        groups = json.load(resp)["data"]["groups"]
    return [(r["name"], r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]]


def left_side(expr: str) -> str:
    """An alert's expression without its final comparison: what it selects (for absent(x), x:
    it fires on the very absence of what it selects)."""
    absent = re.match(r"(?s)^absent\((.*)\)$", expr.strip())
    if absent:
        return absent.group(1)
    m = re.match(r"(?s)^(.*?)\s*(>|<|==|!=|>=|<=)\s*[0-9.]+\s*$", expr.strip())
    assert m, expr
    return m.group(1)


@pytest.mark.timeout(420)
def test_counters_move_by_what_was_injected_and_the_alerts_fire(tmp_path, ledger):
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
    )
    cluster = ClusterConfig(
        model="tiny-llama", num_prefill=1, num_decode=2, engine=engine,
        kv_faults=FaultPlan(FaultKind.CORRUPT, every=2), kv_transfer_deadline_s=3,
    )  # fmt: skip
    srv = ServerThread(
        ServeConfig(
            cluster=cluster, router=RouterConfig(max_pending=2), port=0, metrics_port=0,
            drain_timeout_s=5,
        )
    )  # fmt: skip
    try:
        with prometheus(srv.server.metrics_port, tmp_path, alert_for="0s") as port, \
                grpc.insecure_channel(srv.address) as ch:  # fmt: skip
            stub = pb_grpc.GenerationStub(ch)
            # 1. Six disaggregated requests: every second send of the prefill worker corrupted.
            fell = []
            for p in random_prompts([21, 34, 19, 27, 40, 15], seed=181):
                msgs = list(stub.Generate(request(p, pb.PATH_DISAGGREGATED, 4), timeout=60))
                fell.append(msgs[-1].final.kv_fallback)
            ledger.add(sent=6, completed=6)
            struck = fell.count("transfer_failed")
            assert struck == 3 and set(fell) == {"", "transfer_failed"}, fell
            ledger.add(injected=struck)

            # 2. A flood past admission (at most 2 requests may wait for a first token).
            prompt = random_prompts([30], seed=182)[0]
            calls = [stub.Generate(request(prompt, pb.PATH_COLOCATED, 16), timeout=120)
                     for _ in range(FLOOD)]  # fmt: skip
            refused = ok = 0
            for call in calls:
                try:
                    for _ in call:
                        pass
                    ok += 1
                except grpc.RpcError as exc:
                    assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert dict(exc.trailing_metadata() or ())["retry-after-ms"]
                    refused += 1
            ledger.add(sent=FLOOD, completed=ok, failed=refused)
            assert refused > 35, (refused, ok)

            # 3. A decode worker killed under long streams: each one it held resumes elsewhere.
            outs: list[list[int]] = [[] for _ in range(STREAMS)]
            done: list[float] = []
            cluster_ = srv.server.cluster
            resumed0 = srv.server.core.resumed

            def stream(i: int, first: threading.Event) -> None:
                p = random_prompts([12 + i], seed=183 + i)[0]
                for m in stub.Generate(request(p, pb.PATH_COLOCATED, LONG), timeout=120):
                    outs[i].extend(m.token_ids)
                    first.set()
                done.append(time.monotonic())

            threads = []
            for i in range(STREAMS):  # one at a time: each waits for its first token
                first = threading.Event()
                threads.append(threading.Thread(target=stream, args=(i, first)))
                threads[-1].start()
                assert first.wait(60)
            held = {w: srv.server.core.states[w].batch for w in cluster_.decode_ids}
            victim = max(held, key=lambda w: held[w])
            assert held[victim] > 0 and not done, (held, done)
            killed_at = time.monotonic()
            os.kill(cluster_.worker_info(victim).pid, signal.SIGKILL)
            for t in threads:
                t.join(150)
            assert [len(o) for o in outs] == [LONG] * STREAMS
            assert min(done) > killed_at  # every stream was still running when it struck
            ledger.add(sent=STREAMS, completed=STREAMS, injected=1)
            resumed = srv.server.core.resumed - resumed0
            assert resumed == held[victim]
            deadline = time.monotonic() + 120
            while (
                cluster_.restarts[cluster_.pools.workers[victim].role] < 1
                or len(cluster_.decode_ids) < 2
            ):
                assert time.monotonic() < deadline, "the killed worker was not replaced"
                time.sleep(0.2)

            # The router's counters: exactly what was injected, as the clients saw it.
            failures = counters(srv, "pdserve_kv_transfer_failures_total", "reason")
            assert failures["corrupt"] == struck and sum(failures.values()) == struck, failures
            fallbacks = counters(srv, "pdserve_local_prefill_fallbacks_total", "reason")
            assert fallbacks["transfer_failed"] == struck, fallbacks
            assert sum(fallbacks.values()) == struck, fallbacks
            rejections = counters(srv, "pdserve_admission_rejections_total", "reason")
            assert sum(rejections.values()) == refused, rejections
            assert counters(srv, "pdserve_requests_resumed_total", "")[""] == resumed
            lost = counters(srv, "pdserve_worker_failures_total", "worker")
            assert lost[victim] == 1 and sum(lost.values()) == 1, lost
            for gauge in ("pdserve_requests_pending", "pdserve_requests_active"):
                assert counters(srv, gauge, "") == {"": 0.0}, gauge  # every request settled
            # The router reports the restart at its next poll of the workers, after the cluster
            # saw it: wait for that poll (bounded), then exactly one.
            restarts = counters(srv, "pdserve_worker_restarts_total", "role")
            while restarts.get("decode", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
                restarts = counters(srv, "pdserve_worker_restarts_total", "role")
            assert restarts == {"decode": 1, "prefill": 0, "both": 0}, restarts
            # `pdserve status` says which worker was lost, and that nothing is in flight.
            samples = status.scrape(f"127.0.0.1:{srv.server.metrics_port}")
            text = status.render(samples, samples, 1.0, "test")
            assert f"workers lost (died or hung): {victim} 1\n" in text, text
            assert "; 0 active, 0 of them before their first token" in text, text

            # Prometheus: the matching alerts fire, the others stay quiet.
            want = {
                ("PdserveKVTransferFailures", "reason", "corrupt"),
                ("PdserveLocalPrefillFallbacks", "reason", "transfer_failed"),
                ("PdserveWorkerFailed", "worker", victim),
            }
            deadline = time.monotonic() + 60
            while True:
                now = [a["labels"] for a in alerts(port) if a["state"] == "firing"]
                missing = [
                    w for w in want
                    if not any(a["alertname"] == w[0] and a.get(w[1]) == w[2] for a in now)
                ]  # fmt: skip
                refusing = {a.get("reason") for a in now
                            if a["alertname"] == "PdserveAdmissionRejections"}  # fmt: skip
                if not missing and refusing & {r for r, v in rejections.items() if v}:
                    break
                assert time.monotonic() < deadline, (missing, now, rule_health(port))
                time.sleep(0.5)
            names = {a["alertname"] for a in now}
            assert not names & {"PdserveDown", "PdserveAbsent", "PdserveNoWorkers"}, names
            # Every alert selects series that exist: none is an expression over nothing.
            for rule in rules():
                got = api(port, left_side(rule["expr"]))["data"]["result"]
                assert got, f"{rule['alert']}: {left_side(rule['expr'])} selects nothing"
        pools_full(srv.server.cluster)
    finally:
        srv.close()
