"""pdserve's metrics against a real Prometheus server (Debian's `prometheus`, which .ci/run
installs): the repository's prometheus.yml and alerts.yml (targets rewritten to this test's
ports), a short mixed load, then Prometheus' HTTP API and `pdserve status`."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import statistics
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import yaml

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router import status
from router.cluster import ClusterConfig
from router.serve_config import ServeConfig
from tests.grpc_server import ServerThread
from tests.helpers import random_prompts
from tests.prometheus_server import DEPLOY, api, rules, tool
from tests.prometheus_server import prometheus as run_prometheus
from tests.test_router_grpc import assert_pools_full

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4


def dashboard_exprs() -> list[str]:
    doc = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    return [e.replace("$__rate_interval", "1m").replace("$__range", "5m") for e in exprs]


def alert_exprs() -> list[str]:
    return [r["expr"] for r in rules()]


@pytest.fixture(scope="module")
def srv():
    engine = EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16),
    )
    config = ServeConfig(
        cluster=ClusterConfig(model="tiny-llama", num_prefill=1, num_decode=1, engine=engine),
        port=0,
        metrics_port=0,
        drain_timeout_s=5,
    )
    s = ServerThread(config)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def pools_full_after_each_test(request):
    """After each test that ran on the module's server, every live worker's pool is full and
    idle, and the router's books are empty (a test without the server does not start one)."""
    srv = request.getfixturevalue("srv") if "srv" in request.fixturenames else None
    yield
    if srv is not None:
        assert_pools_full(srv, within_s=5)


@pytest.fixture(scope="module")
def prometheus(srv, tmp_path_factory):
    d = tmp_path_factory.mktemp("prometheus")
    with run_prometheus(srv.server.metrics_port, d) as port:
        yield port, d


def test_promtool_accepts_the_config_and_the_rules():
    assert (
        subprocess.run(
            [tool("promtool"), "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
            capture_output=True,
        ).returncode
        == 0
    )
    out = subprocess.run(
        [tool("promtool"), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_decode_worker_without_room_is_no_broken_handoff_path(tmp_path):
    """Handoffs that fall back for lack of room on the decode worker (no_reservation) are
    capacity: the fallback alert, which points at the network between the nodes, stays quiet
    for them and fires for the others; an alert of their own fires where most handoffs
    find no room for a quarter of an hour."""
    summary = next(r for r in rules() if r["alert"] == "PdserveLocalPrefillFallbacks")
    said = summary["annotations"]["summary"].replace("{{ $labels.reason }}", "transfer_failed")
    room = next(r for r in rules() if r["alert"] == "PdserveHandoffsWithoutRoom")
    room = room["annotations"]["summary"].replace("{{ $value | humanizePercentage }}", "83.33%")
    test = {
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": 'pdserve_local_prefill_fallbacks_total{reason="no_reservation"}',
                 "values": "0+10x30"},
                {"series": 'pdserve_local_prefill_fallbacks_total{reason="transfer_failed"}',
                 "values": "0+1x30"},
                {"series": 'pdserve_requests_total{path="disaggregated",finish_reason="length",'
                           'frontend="grpc"}',
                 "values": "0+12x40"},
            ],
            "alert_rule_test": [{
                "eval_time": "20m",
                "alertname": "PdserveLocalPrefillFallbacks",
                "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "reason": "transfer_failed"},
                    "exp_annotations": {"summary": said},
                }],
            }, {
                "eval_time": "29m",  # 10 of 12 handoffs a minute without room, for 15 min
                "alertname": "PdserveHandoffsWithoutRoom",
                "exp_alerts": [{
                    "exp_labels": {"severity": "warning"},
                    "exp_annotations": {"summary": room},
                }],
            }, {
                "eval_time": "10m",  # not yet for 15 min
                "alertname": "PdserveHandoffsWithoutRoom",
                "exp_alerts": [],
            }],
        }],
    }  # fmt: skip
    (tmp_path / "t.yml").write_text(yaml.safe_dump(test))
    out = subprocess.run(
        [tool("promtool"), "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def script(path: Path):
    """A deploy/ script, loaded as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_operators_rules_are_what_their_script_writes_from_alerts_yml():
    mod = script(DEPLOY / "prometheus" / "make_rule.py")
    text = (DEPLOY / "kuberay" / "prometheusrule.yaml").read_text()
    assert text == mod.render(), "run python deploy/prometheus/make_rule.py"
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert yaml.safe_load(text)["spec"] == rules


def test_the_dashboard_is_what_its_script_writes():
    mod = script(DEPLOY / "grafana" / "make_dashboard.py")
    assert (DEPLOY / "grafana" / "pdserve.json").read_text() == mod.render(), (
        "run python deploy/grafana/make_dashboard.py"
    )


def _run(stub, ids, path):
    req = pb.GenerateRequest(
        prompt_token_ids=ids,
        sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        path=path,
    )
    t0 = time.monotonic()
    first = None
    final = None
    for msg in stub.Generate(req, timeout=60):
        if first is None and msg.token_ids:
            first = time.monotonic() - t0
        if msg.HasField("final"):
            final = msg.final
    return first, final


@pytest.mark.timeout(240)
def test_metrics_through_a_real_prometheus(srv, prometheus):
    port, _ = prometheus
    lengths = [9, 17, 23, 30, 41, 52]
    prompts = random_prompts(lengths * 2, seed=123)  # every prompt fresh: no prefix hits
    paths = [pb.PATH_COLOCATED] * len(lengths) + [pb.PATH_DISAGGREGATED] * len(lengths)
    info = srv.server.core.states["decode-0"].info
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        results = [_run(stub, p, path) for p, path in zip(prompts, paths)]
        for bad in (pb.GenerateRequest(), pb.GenerateRequest(prompt_token_ids=[1, 9999])):
            with pytest.raises(grpc.RpcError):
                stub.Complete(bad, timeout=10)  # refused: not a request that ran
    n = len(prompts)
    # Counters, read straight from the endpoint: exactly the requests that ran.
    samples = status.scrape(f"127.0.0.1:{srv.server.metrics_port}")
    total = sum(v for (name, _), v in samples.items() if name == "pdserve_requests_total")
    assert total == n
    sent = sum(v for (name, _), v in samples.items() if name == "pdserve_kv_transfer_bytes_total")
    want = sum(
        math.ceil(len(p) / BLOCK) * BLOCK * info.kv_bytes_per_token
        for p, path in zip(prompts, paths)
        if path == pb.PATH_DISAGGREGATED
    )
    assert sent == want
    # TTFT at the router agrees with the client's within a few milliseconds at the median: the
    # gap is the gRPC hop and the scheduling of client, router and workers on shared cores
    # (2-11 ms, median 6.3 ms, on a day this 2-core host ran 1.7x slower than usual).
    diffs = [abs(client - final.ttft_ms / 1000) for client, final in results]
    assert statistics.median(diffs) < 0.015, diffs
    # Prometheus has scraped it all: wait for the count to arrive.
    deadline = time.monotonic() + 30
    while True:
        got = api(port, "sum(pdserve_requests_total)")["data"]["result"]
        if got and float(got[0]["value"][1]) == n:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.5)
    up = api(port, 'up{job="pdserve"}')["data"]["result"]
    assert [float(r["value"][1]) for r in up] == [1.0]
    for expr in dashboard_exprs() + alert_exprs():
        res = api(port, expr)
        assert res["status"] == "success", (expr, res)
    # Every panel draws something after this load (a misspelt label selects nothing); a rate
    # needs two scrapes of a series that the load created.
    deadline = time.monotonic() + 30
    while empty := [e for e in dashboard_exprs() if not api(port, e)["data"]["result"]]:
        assert time.monotonic() < deadline, empty
        time.sleep(0.5)
    for series in (
        "pdserve_time_to_first_token_seconds_count",
        "pdserve_inter_token_latency_seconds_count",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_seconds_count",
        "pdserve_path_decisions_total",
        "pdserve_worker_kv_cache_usage_ratio",
    ):
        assert api(port, series)["data"]["result"], f"no data for {series}"
    by_path = api(port, "sum by (path) (pdserve_time_to_first_token_seconds_count)")
    counts = {r["metric"]["path"]: float(r["value"][1]) for r in by_path["data"]["result"]}
    assert counts == {"colocated": len(lengths), "disaggregated": len(lengths)}
    # `pdserve status` shows the same figures.
    text = status.render(samples, samples, 1.0, "test")
    assert f"requests: {n} (colocated {len(lengths)}, disaggregated {len(lengths)})" in text
    assert "decode-0" in text and "prefill-0" in text
    assert "steps beside a busy peer on the node (measured, else a prior): 127.0.0.1 " in text
    assert "how far predictions err (sd of ln(measured / predicted)): itl_p99 decode-0 " in text
    assert "gaps at the router over steps: decode-0 " in text
    assert "measured p99 gap over predicted: decode-0 colocated " in text
    assert f"KV transfers: {len(lengths)} done" in text
    assert re.search(r"latest \d+\.\d\d [kMG]?B/s", text), text  # in units that show it
    assert "resumed on another worker (theirs lost): 0" in text
    assert "TTFT p50 / p99 since start: colocated " in text
    # Per worker: the prefills placed on it, for a peer or to decode itself.
    placed = status.by_labels(samples, "pdserve_worker_prefills_total", "worker", "kind")
    assert placed[("prefill-0", "for_peer")] == len(lengths)
    assert placed[("decode-0", "local")] == len(lengths)
    assert placed[("decode-0", "for_peer")] == placed[("prefill-0", "local")] == 0
    assert "prefills for peers" in text


def test_the_server_exports_no_created_series():
    from prometheus_client import generate_latest

    from router.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    assert "pdserve_requests_resumed_total" in text and "_created" not in text


def test_every_metric_the_dashboard_alerts_and_status_use_exists():
    """A renamed metric must not blank a panel, an alert or a status line silently."""
    import re

    from router.metrics import Metrics

    known = set()
    for fam in Metrics().registry.collect():
        known.add(fam.name)
        known.update(s.name for s in fam.samples)
    texts = [
        (DEPLOY / "grafana" / "pdserve.json").read_text(),
        (DEPLOY / "prometheus" / "alerts.yml").read_text(),
        (ROOT / "router" / "status.py").read_text(),
        (ROOT / "pdserve_client" / "metrics.py").read_text(),
    ]
    used = {m for t in texts for m in re.findall(r"pdserve_[a-z_]+", t)}
    used -= {"pdserve_client", "pdserve_proto"}  # the packages' own names, imported there
    suffixes = ("_bucket", "_count", "_sum", "_total")
    missing = {
        m for m in used if m not in known and not any(m.removesuffix(x) in known for x in suffixes)
    }
    assert not missing


def test_steps_with_prompts_waiting_count_per_worker_and_show_in_status():
    """The worker reports its total since start; the counter grows by what it grew, and
    `pdserve status` names the workers where prompts waited for decodes."""
    from router import status
    from router.metrics import Metrics
    from worker_protocol.messages import WorkerLoad, WorkerRole

    m = Metrics()

    def load(steps):
        return WorkerLoad("both-0", WorkerRole.BOTH, 1, 0, 0, 0.1, 900, 1000, 0,
                          prompt_wait_steps=steps)  # fmt: skip

    m.loads([load(5)])
    m.loads([load(12)])
    samples = _samples(m)
    waits = status.by_labels(samples, "pdserve_worker_prompt_wait_steps_total", "worker", "role")
    assert waits == {("both-0", "both"): 12.0}
    text = status.render(samples, samples, 1.0, "127.0.0.1:0")
    assert "steps run with prompts waiting for short decodes: both-0 12" in text


def test_how_busy_each_worker_was_counts_its_step_seconds_and_shows_in_status():
    """The worker reports the seconds its engine ran steps since it started; the counter grows
    by what that grew, and `pdserve status` shows each worker's share of the interval between
    its two scrapes."""
    from router import status
    from router.metrics import Metrics
    from worker_protocol.messages import WorkerLoad, WorkerRole

    m = Metrics()

    def loads(prefill_busy, decode_busy):
        m.loads([
            WorkerLoad("prefill-0", WorkerRole.PREFILL, 0, 0, 0, 0.1, 900, 1000, 0,
                       busy_s=prefill_busy),
            WorkerLoad("decode-0", WorkerRole.DECODE, 3, 0, 0, 0.1, 900, 1000, 0,
                       busy_s=decode_busy),
        ])  # fmt: skip

    loads(2.0, 1.0)
    before = _samples(m)
    loads(2.6, 4.8)  # over 4 s: the prefill worker ran steps 0.6 s of them, the decode one 3.8
    after = _samples(m)
    busy = status.by_labels(after, "pdserve_worker_busy_seconds_total", "worker")
    assert busy == {("prefill-0",): 2.6, ("decode-0",): 4.8}
    rows = {
        line.split()[0]: line.split()
        for line in status.render(before, after, 4.0, "127.0.0.1:0").splitlines()
    }
    assert rows["worker"][-1] == "busy"
    assert rows["prefill-0"][-1] == "15%" and rows["decode-0"][-1] == "95%"
    # A worker absent from the first scrape has no share yet; nor has one whose count went down
    # between the two (the router started afresh).
    assert status.render({}, after, 4.0, "127.0.0.1:0").splitlines()[3].split()[-1] == "-"
    assert status.render(after, before, 4.0, "127.0.0.1:0").splitlines()[3].split()[-1] == "-"
    # A worker started afresh reports a smaller total: the counter grows by all of it.
    m.loads([WorkerLoad("decode-0", WorkerRole.DECODE, 0, 0, 0, 0.0, 1000, 1000, 0, busy_s=0.7)])
    assert status.by_labels(_samples(m), "pdserve_worker_busy_seconds_total", "worker")[
        ("decode-0",)
    ] == pytest.approx(5.5)


def _samples(m):
    """What a scrape of `m`'s registry reads."""
    from prometheus_client import generate_latest

    from pdserve_client.metrics import parse

    return parse(generate_latest(m.registry).decode())


@pytest.mark.timeout(60)
def test_the_metrics_endpoint_answers_while_the_workers_start():
    """Prometheus sees the router up while its pools come up (minutes on a cluster whose nodes
    boot): deploy/prometheus/alerts.yml's PdserveDown must not fire at every start."""
    import asyncio
    import threading
    import urllib.request

    from engine.config import ModelConfig
    from engine.loader import load_tokenizer
    from router.fake_backend import FakeBackend
    from router.server import Server

    up = threading.Event()

    class Starting(FakeBackend):
        async def infos(self):  # the pools come up once `up` is set
            assert await asyncio.to_thread(up.wait, 30)
            return await super().infos()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = Server(
        ServeConfig(port=0, metrics_port=0), backend=Starting(),
        tokenizer=load_tokenizer(ModelConfig(model="tiny-llama")),
    )  # fmt: skip
    started = asyncio.run_coroutine_threadsafe(server.start(), loop)
    try:
        deadline = time.monotonic() + 20
        while not server.metrics_port:
            assert time.monotonic() < deadline and not started.done()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"

        def workers_series() -> list[str]:
            with urllib.request.urlopen(url, timeout=10) as answer:
                assert answer.status == 200
                text = answer.read().decode()
            assert "pdserve_requests_resumed_total" in text
            return [line for line in text.splitlines() if line.startswith("pdserve_workers{")]

        # No pdserve_workers series yet: 0 would fire PdserveNoWorkers during every start.
        assert workers_series() == []
        assert not started.done() and server.port == 0  # the pools are still starting
        up.set()
        started.result(30)
        assert server.port
        deadline = time.monotonic() + 20  # the core's first report
        while not any(
            line.startswith('pdserve_workers{role="decode"} 1') for line in workers_series()
        ):
            assert time.monotonic() < deadline, workers_series()
            time.sleep(0.1)
    finally:
        up.set()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
