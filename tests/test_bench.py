"""pdserve bench: traces, SLO maths, and a short end-to-end run over two policies (tiny model)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from bench import cli, report, session, slo, trace
from bench.loadgen import RequestResult
from bench.server import ServerProcess


def test_builtin_traces_load_scale_and_draw_the_same_tokens():
    mixed = trace.load("mixed")
    assert len(mixed) == 200
    assert sum(1 for r in mixed if r.prompt_len >= 1024) > 10  # the long prompts are there
    few = trace.load("mixed", num_requests=5, scale=0.5)
    assert [r.prompt_len for r in few] == [round(r.prompt_len * 0.5) for r in mixed[:5]]
    a = trace.prompt_ids(mixed[3], 3, 1000, seed=1)
    assert a == trace.prompt_ids(mixed[3], 3, 1000, seed=1) and len(a) == mixed[3].prompt_len
    assert a != trace.prompt_ids(mixed[3], 3, 1000, seed=2)


def test_shared_prefixes_are_the_same_tokens(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"arrival_s": 0.1, "prompt_len": 40, "output_len": 4, "prefix_id": "sys", "prefix_len": 32},
        {"arrival_s": 0.2, "prompt_len": 50, "output_len": 4, "prefix_id": "sys", "prefix_len": 32},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    a, b = trace.load(str(path))
    ia, ib = trace.prompt_ids(a, 0, 500, 0), trace.prompt_ids(b, 1, 500, 0)
    assert ia[:32] == ib[:32] and ia[32:] != ib[32:40]


def test_synthetic_prefixes_open_prompts_with_one_of_k_system_prompts():
    reqs = trace.synthetic(60, (8, 16), (4, 8), 1.0, seed=5, prefixes=(3, 40))
    assert all(r.prefix_len == 40 and 48 <= r.prompt_len <= 56 for r in reqs)
    assert {r.prefix_id for r in reqs} == {"system-0", "system-1", "system-2"}
    ids = [trace.prompt_ids(r, i, 500, 5) for i, r in enumerate(reqs)]
    heads: dict = {}
    for r, got in zip(reqs, ids):
        assert heads.setdefault(r.prefix_id, got[:40]) == got[:40]  # the same prefix tokens
    assert len({tuple(h) for h in heads.values()}) == 3  # and three different ones
    assert len({tuple(got[40:]) for got in ids}) == 60  # each with its own tail
    plain = trace.synthetic(60, (8, 16), (4, 8), 1.0, seed=5)
    assert [r.arrival_s for r in plain] == [r.arrival_s for r in reqs]  # same arrivals
    assert all(r.prefix_id is None for r in plain)


def test_the_cached_share_is_of_completed_requests_prompt_tokens():
    done = _result(0.5, [0.05] * 3)
    done.prompt_len, done.cached_tokens = 100, 64
    other = _result(0.5, [0.05] * 3)
    other.prompt_len = 60
    failed = _result(0.5, [0.05] * 3, status="UNAVAILABLE")
    failed.prompt_len, failed.cached_tokens = 1000, 1000
    got = slo.figures([done, other, failed], slo.Slo(ttft_s=1.0, itl_s=0.1), 10.0)
    assert got["cached_share"] == 64 / 160
    assert slo.figures([], slo.Slo(ttft_s=1.0, itl_s=0.1), 1.0)["cached_share"] == 0


def test_bad_trace_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 3, "output_len": 1}\n{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        trace.load(str(path))


def test_sharegpt_files_become_text_prompts(tmp_path):
    path = tmp_path / "sg.json"
    doc = [
        {
            "conversations": [
                {"from": "human", "value": "x" * 400},
                {"from": "gpt", "value": "y" * 80},
            ]
        }
    ]
    path.write_text(json.dumps(doc))
    (r,) = trace.load(str(path))
    assert r.prompt_text == "x" * 400 and r.prompt_len == 100 and r.output_len == 20


def _result(ttft, gaps, status="OK", n=None):
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    n = len(times) if n is None else n
    return RequestResult(0, 10, n, 0.0, ttft, times, times[-1], len(times), status)


def test_attainment_needs_both_ttft_and_itl():
    objective = slo.Slo(ttft_s=1.0, itl_s=0.1)
    assert slo.attains(_result(0.5, [0.05] * 10), objective)
    assert not slo.attains(_result(1.5, [0.05] * 10), objective)  # TTFT missed
    assert not slo.attains(_result(0.5, [0.05] * 9 + [2.0]), objective)  # one stall: p99 missed
    assert not slo.attains(_result(0.5, [0.05] * 10, status="UNAVAILABLE"), objective)
    assert not slo.attains(_result(0.5, [0.05] * 10, n=20), objective)  # fewer tokens than asked
    tpot = slo.Slo(ttft_s=1.0, itl_s=0.3, itl_metric="tpot")
    assert slo.attains(_result(0.5, [0.05] * 9 + [2.0]), tpot)  # the mean forgives one stall
    figs = slo.figures(
        [
            _result(0.5, [0.05] * 10),
            _result(2.0, [0.05] * 10),
            _result(0.5, [], "RESOURCE_EXHAUSTED", n=5),
        ],
        objective,
        wall_s=2.0,
    )
    assert figs["completed"] == 2 and figs["rejected"] == 1 and figs["failed"] == 0
    assert figs["kv_fallbacks"] == 0
    assert figs["attainment"] == pytest.approx(1 / 3) and figs["goodput_rps"] == 0.5
    fell_back = _result(0.5, [0.05] * 10)
    fell_back.kv_fallback = "transfer_failed"
    figs = slo.figures([fell_back, _result(0.5, [0.05] * 10)], objective, wall_s=2.0)
    assert figs["kv_fallbacks"] == 1 and figs["attainment"] == 1.0  # counted, not a miss


def test_attainment_at_the_runs_average_host_speed_scales_each_policys_slos_by_its_lone_gap(
    capsys,
):
    objective = slo.Slo(ttft_s=1.0, itl_s=0.1)
    # Every gap 110 ms: past the 100 ms SLO, within it once scaled by 1.2 (a host 20% slower).
    slow = [_result(0.5, [0.11] * 10) for _ in range(4)]
    fast = [_result(0.5, [0.09] * 10) for _ in range(2)] + [_result(0.5, [0.11] * 10)] * 2
    runs = {"flex": slow, "disaggregated": fast}
    got = slo.host_scaled(runs, {"flex": 0.06, "disaggregated": 0.04}, objective)
    assert got["flex"]["factor"] == pytest.approx(1.2)
    assert got["disaggregated"]["factor"] == pytest.approx(0.8)
    assert got["flex"]["attainment"] == 1.0  # 110 ms <= 120 ms
    assert got["disaggregated"]["attainment"] == 0.0  # not even 90 ms <= 80 ms
    assert slo.host_scaled(runs, {"flex": 0.06, "disaggregated": None}, objective) == {}
    assert slo.host_scaled({"flex": slow}, {"flex": 0.06}, objective) == {}
    pol = {p: dict(slo.figures(rs, objective, 1.0), lone_gap_s=g)
           for (p, rs), g in zip(runs.items(), (0.06, 0.04))}  # fmt: skip
    out = {"trace": "mixed", "num_requests": 4, "rate": 1.0, "policies": pol,
           "slo": {"ttft_s": 1.0, "itl_s": 0.1, "itl_metric": "itl_p99"}}  # fmt: skip
    report.table(out, runs, argparse.Namespace(long_prompt=512))
    assert out["host_scaled"] == got
    assert "flex 100% (x1.20), disaggregated 0% (x0.80)" in capsys.readouterr().out


def test_the_table_shows_each_policys_kv_fallbacks(capsys):
    objective = slo.Slo(ttft_s=1.0, itl_s=0.1)
    fell_back = [_result(0.5, [0.05] * 10) for _ in range(3)]
    for r in fell_back[:2]:
        r.kv_fallback = "pair_not_ready"
    pol = {"disaggregated": slo.figures(fell_back, objective, 1.0),
           "flex": slo.figures([_result(0.5, [0.05] * 10)], objective, 1.0)}  # fmt: skip
    out = {"trace": "mixed", "num_requests": 3, "rate": 1.0, "policies": pol}
    report.table(out, {}, argparse.Namespace(long_prompt=512))
    lines = capsys.readouterr().out.splitlines()
    head = lines[1].split()
    col = head.index("kvfb")  # the cells before it are one word each, as in the header
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert rows["disaggregated"][col] == "2" and rows["flex"][col] == "0"


@pytest.mark.timeout(300)
def test_two_policies_end_to_end(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "out.json"
    args = parser.parse_args(
        [
            "--model", "tiny-llama", "--trace", "mixed", "--num-requests", "10",
            "--scale", "0.2", "--rate", "20", "--policy", "colocated-nochunk,disaggregated,flex",
            "--kv-cache-gib", "0.05", "--long-prompt", "150",
            # Without the SLO hint: milliseconds-long SLOs of a tiny model would let admission
            # refuse requests that queue, which this test is not about.
            "--no-slo-hint",
            "--json", str(out), "--plot", str(tmp_path / "plots"),
        ]
    )  # fmt: skip
    assert cli.run(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"colocated-nochunk", "disaggregated", "flex"}
    assert doc["slo"]["ttft_s"] > 0 and doc["slo"]["itl_s"] > 0
    for fig in doc["policies"].values():
        assert fig["completed"] == 10 and fig["failed"] == fig["rejected"] == 0
        assert fig["kv_fallbacks"] == 0  # every handoff's KV arrived
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert set(fig[key]) == {"p50", "p90", "p99", "mean"}
        assert 0 <= fig["attainment"] <= 1 and fig["throughput_rps"] > 0
    assert len(doc["requests"]) == 30
    paths = {r["policy"]: {x["path"] for x in doc["requests"] if x["policy"] == r["policy"]}
             for r in doc["requests"]}  # fmt: skip
    assert paths["colocated-nochunk"] == {"colocated"} and paths["disaggregated"] == {
        "disaggregated"
    }
    # flex: two workers that do both, each request placed on them by auto (P != D when handed
    # off), every handoff's KV delivered.
    flex = [x for x in doc["requests"] if x["policy"] == "flex"]
    assert {x["decode_worker"] for x in flex} <= {"both-0", "both-1"}
    for x in flex:
        assert x["decision_reason"] and not x["kv_fallback"], x
        if x["path"] == "disaggregated":
            assert x["prefill_worker"] in {"both-0", "both-1"} - {x["decode_worker"]}, x
        else:
            assert x["prefill_worker"] == "", x
    # Each request carries what the router predicted for the placement it took.
    for x in doc["requests"]:
        assert (x["predicted_ttft_s"] or 0) > 0 and (x["predicted_itl_p99_s"] or 0) > 0, x
    assert doc["baseline"]["itl_s"]["p99"] is not None
    # How busy each worker was over its policy's run, read from that server's metrics: every
    # worker of the deployment, the split's prefill and decode worker both at work.
    workers = {
        "colocated-nochunk": {"decode-0", "decode-1"},
        "disaggregated": {"prefill-0", "decode-0"},
        "flex": {"both-0", "both-1"},
    }
    for policy, fig in doc["policies"].items():
        assert set(fig["busy"]) == workers[policy], fig["busy"]
        assert all(0 <= v <= 1 for v in fig["busy"].values()) and sum(fig["busy"].values()) > 0
    assert min(doc["policies"]["disaggregated"]["busy"].values()) > 0
    # Where the host's CPU went: each worker's process by name (the pids its admin service
    # lists), the router's, the rest, this bench; every core once.
    for policy, fig in doc["policies"].items():
        cpu = fig["host_cpu"]
        assert set(cpu) == workers[policy] | {"router", "ray", "bench", "elsewhere", "idle"}, cpu
        assert sum(cpu[w] for w in workers[policy]) > 0 and cpu["router"] > 0, cpu
        assert sum(cpu.values()) == pytest.approx(psutil.cpu_count(), abs=0.3), cpu
    # What the router predicted for each placement against what each request saw.
    for fig in doc["policies"].values():
        assert fig["predictions"]["all"]["requests"] == 10
    assert (tmp_path / "plots" / "itl_over_time.png").stat().st_size > 0
    assert (tmp_path / "plots" / "cdf.png").stat().st_size > 0


def test_summaries_and_tpot():
    figs = slo.summary([1.0, 2.0, 3.0, 4.0, 100.0])
    assert figs["p50"] == 3.0 and figs["mean"] == 22.0
    assert figs["p99"] == pytest.approx(96.16)  # numpy's linear interpolation
    r = _result(0.5, [0.1] * 10)  # 11 tokens: TTFT 0.5 s, then 10 gaps of 0.1 s
    assert slo.tpot(r) == pytest.approx(0.1)
    assert slo.summary([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_baseline_is_skipped_when_every_prompt_is_long():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--trace", "long-prompt", "--long-prompt", "512"])
    reqs = trace.load("long-prompt")
    assert min(r.prompt_len for r in reqs) >= 512
    # No server at this address: a skipped baseline sends nothing.
    base = cli._baseline("127.0.0.1:1", reqs, 100, args, slo.Slo(1.0, 0.1, "itl_p99"))
    assert base["requests"] == 0 and "long-prompt 512" in base["skipped"]


def test_sweep_finds_the_highest_rate_that_attains_90_percent(monkeypatch):
    # A fake server that attains every request up to 0.5 req/s and none above.
    def fake_run(address, reqs, rate, vocab, args, label, objective=None, seed=None):
        ttft = 0.1 if rate <= 0.5 else 5.0
        return [_result(ttft, [0.01] * 4) for _ in reqs], 10.0

    monkeypatch.setattr(session, "run_trace", fake_run)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--rate", "0.4"])
    reqs = trace.load("mixed", num_requests=5)
    best, points = cli._sweep("x", reqs, 100, slo.Slo(1.0, 0.1), args, "auto", [])
    assert len(points) == 5  # five probes between rate / 4 and rate * 4
    assert all(0.1 - 1e-9 <= p["rate"] <= 1.6 + 1e-9 for p in points)
    assert 0.4 <= best <= 0.5  # the binary search closes in on the edge from below
    # Goodput only where it attains, and each probe's attainment is kept (for the JSON).
    assert all((p["goodput_rps"] > 0) == (p["rate"] <= 0.5) for p in points)
    assert all(p["attainment"] == (1.0 if p["rate"] <= 0.5 else 0.0) for p in points)


def test_a_sweep_over_given_rates_probes_each_of_them_and_reports_the_highest(monkeypatch, capsys):
    # A fake server whose attainment does not fall with the rate: it misses at 1.0 req/s only.
    probed: list[float] = []

    def fake_run(address, reqs, rate, vocab, args, label, objective=None, seed=None):
        probed.append(rate)
        ttft = 5.0 if rate == 1.0 or rate > 1.5 else 0.1
        return [_result(ttft, [0.01] * 4) for _ in reqs], 10.0

    monkeypatch.setattr(session, "run_trace", fake_run)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--sweep-rate", "--sweep-rates", "1.5,0.5,1.0,2.0"])
    assert args.sweep_rates == [0.5, 1.0, 1.5, 2.0]  # sorted, probed low to high
    reqs = trace.load("mixed", num_requests=5)
    records: list[dict] = []
    best, points = cli._sweep("x", reqs, 100, slo.Slo(1.0, 0.1), args, "flex", records)
    assert probed == [0.5, 1.0, 1.5, 2.0]  # every rate, whatever the one before attained
    # Every probe's request records are kept, tagged with the policy and the probe's rate.
    assert [(r["policy"], r["probe_rate"]) for r in records] == [
        ("flex", rate) for rate in (0.5, 1.0, 1.5, 2.0) for _ in reqs
    ]
    assert all("ttft_s" in r and "itl_s" in r for r in records)
    assert best == 1.5  # the highest rate probed at >= 90%, past a miss at a lower one
    assert [p["attainment"] for p in points] == [1.0, 0.0, 1.0, 0.0]

    out = {
        "policies": {
            "flex": {"max_rate_at_90pct": best, "sweep": points},
            "auto": {"max_rate_at_90pct": 0.5, "sweep": points[:2]},
            "threshold": {"goodput_rps": 0.3},  # not swept: not in the table
        }
    }
    report.sweeps(out)
    text = capsys.readouterr().out
    assert out["sweep_highest"] == {"rate": 1.5, "policies": ["flex"]}
    assert "highest: flex at 1.50 req/s" in text
    row = next(line for line in text.splitlines() if line.startswith("flex"))
    assert row.split() == ["flex", "100%", "0%", "100%", "0%", "1.50"]
    assert not any(line.startswith("threshold") for line in text.splitlines())
    # Where nothing attained 90% at any rate, no policy is named the highest.
    missed = [dict(p, attainment=0.5) for p in points]
    out = {"policies": {"flex": {"max_rate_at_90pct": 0.0, "sweep": missed}}}
    report.sweeps(out)
    assert out["sweep_highest"] == {"rate": 0.0, "policies": []}
    assert "no policy attained 90%" in capsys.readouterr().out


def test_the_sweep_plot_draws_goodput_and_attainment_per_rate(tmp_path):
    from bench import plots

    points = [
        {"rate": 1.0, "goodput_rps": 0.2, "attainment": 0.4},
        {"rate": 0.5, "goodput_rps": 0.45, "attainment": 0.95},
    ]
    png = plots.goodput_vs_rate({"flex": points, "auto": points[:1]}, tmp_path)
    assert png == tmp_path / "goodput_vs_rate.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bad", ["0.5,0", "fast", "", "nan", "1,inf"])
def test_sweep_rates_that_are_not_positive_numbers_are_refused_naming_the_flag(bad, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--sweep-rate", "--sweep-rates", bad])
    assert "--sweep-rates" in capsys.readouterr().err


def test_sweep_rates_without_a_sweep_are_refused(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--sweep-rates", "0.5,1"])
    assert cli.run(args) == 2
    assert "--sweep-rates" in capsys.readouterr().err


def test_every_policy_gets_the_same_total_workers_laid_out_its_own_way():
    from bench.server import POLICIES, Deployment

    dep = Deployment("tiny-llama", 1, 2, 1, 0.5, 512, 4)

    def layout(policy: str) -> tuple[str, ...]:
        a = dep.args(policy)
        return tuple(a[a.index(f) + 1] for f in ("--prefill", "--decode", "--workers", "--policy"))

    assert layout("auto") == ("1", "2", "0", "auto")
    assert layout("threshold") == ("1", "2", "0", "threshold")
    assert layout("colocated") == ("0", "3", "0", "colocated")
    assert layout("flex") == ("0", "0", "3", "auto")  # all workers do both, placed by auto
    assert "flex" in POLICIES


def test_bench_gpus_per_worker_reaches_every_policys_server_as_serve_reads_it():
    from bench import cli
    from bench.server import POLICIES, Deployment
    from router.cli import build_parser
    from router.effective_options import resolve

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args([]).gpus_per_worker is None
    for policy in POLICIES:  # unset: the servers' own default, no flag
        assert "--gpus-per-worker" not in Deployment("tiny-llama", 1, 1, 1, 0.5, 512, 4).args(
            policy
        )
    share = parser.parse_args(["--gpus-per-worker", "0.5"]).gpus_per_worker
    dep = Deployment("tiny-llama", 1, 1, 1, 0.5, 512, 4, gpus_per_worker=share)
    for policy in POLICIES:
        serve = build_parser().parse_args(["serve", *dep.args(policy)])
        assert resolve(serve).values["gpus_per_worker"] == 0.5, policy
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpus-per-worker", "-1"])


def _all_attain(address, reqs, rate, vocab, args, label, objective=None, seed=None):
    """A run in 10 s of the fake server (`_on_a_fake_server`) where every request attains."""
    return [_result(0.1, [0.01] * 4) for _ in reqs], 10.0


def _on_a_fake_server(monkeypatch, fake_run) -> argparse.ArgumentParser:
    """The bench against a running server (--address) whose runs `fake_run` answers, with SLOs of
    1 s and 100 ms; returns the bench's parser."""

    class Info:
        vocab_size = 100

    monkeypatch.setattr(session, "run_trace", fake_run)
    monkeypatch.setattr(session, "server_info", lambda address, auth: Info())
    monkeypatch.setattr(session, "objective", lambda *a: slo.Slo(1.0, 0.1))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser


def test_repeated_rounds_report_each_rounds_goodput_and_ratio(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a log folder would go

    def fake_run(address, reqs, rate, vocab, args, label, objective=None, seed=None):
        calls.append(label)
        ttft = 5.0 if "round 2" in label else 0.1  # round 2: none attains
        return [_result(ttft, [0.01] * 4) for _ in reqs], 10.0

    parser = _on_a_fake_server(monkeypatch, fake_run)
    out = tmp_path / "out.json"
    args = parser.parse_args(
        ["--address", "x", "--policy", "colocated", "--num-requests", "5", "--repeat", "3",
         "--json", str(out)]
    )  # fmt: skip
    assert cli.run(args) == 0
    doc = json.loads(out.read_text())
    assert [label for label in calls if label != "warm-up"] == [
        f"colocated (round {i}/3)" for i in (1, 2, 3)
    ]
    goods = doc["spread"]["colocated"]["goodput_rps"]
    assert len(doc["rounds"]) == 3 and goods[0] == goods[2] > 0 == goods[1]
    assert doc["spread"]["colocated"]["vs_best_fixed"] == [1.0, 1.0]  # round 2: no goodput
    printed = capsys.readouterr().out
    assert "goodput per round" in printed
    assert "server logs in" not in printed  # it started no server: no (empty) log folder
    # Every round's request records are kept, each with its round.
    assert [x["round"] for x in doc["requests"]] == [1] * 5 + [2] * 5 + [3] * 5
    assert not list(tmp_path.glob("pdserve-bench-*"))


@pytest.mark.parametrize("warmup", [0, 3])
def test_each_server_is_warmed_up_before_its_measured_run(monkeypatch, tmp_path, warmup):
    calls = []

    def fake_run(address, reqs, rate, vocab, args, label, objective=None, seed=None):
        calls.append((label, [(r.prompt_len, r.output_len) for r in reqs], rate, objective, seed))
        return [_result(0.1, [0.01] * 4) for _ in reqs], 10.0

    parser = _on_a_fake_server(monkeypatch, fake_run)
    out = tmp_path / "out.json"
    args = parser.parse_args(
        ["--address", "x", "--policy", "colocated", "--trace", "mixed", "--num-requests", "5",
         "--rate", "0.7", "--repeat", "2", "--warmup", str(warmup), "--json", str(out)]
    )  # fmt: skip
    assert cli.run(args) == 0
    labels = [c[0] for c in calls]
    warm_ups = ["warm-up"] * (2 if warmup else 1)  # a lone request, then the trace's first N
    assert labels == [*warm_ups, "colocated (round 1/2)", *warm_ups, "colocated (round 2/2)"]
    run = calls[len(warm_ups)]
    for at in (0, len(warm_ups) + 1):
        lone = calls[at]
        assert lone[1] == [(16, 32)] and lone[2] == 1.0 and lone[3] is None
        assert lone[4] is not None and lone[4] != run[4]
        if warmup:  # the trace's first requests, at its rate, with the SLO hint, other prompts
            warm = calls[at + 1]
            assert warm[1] == run[1][:warmup] and warm[2] == 0.7 and warm[3] == run[3]
            assert warm[4] not in (None, lone[4], run[4])
    doc = json.loads(out.read_text())
    assert doc["warmup"] == warmup
    # The lone request's median gap (the fake's gaps are 10 ms) is kept with each round's figures.
    assert doc["spread"]["colocated"]["lone_gap_s"] == pytest.approx([0.01, 0.01])
    assert doc["policies"]["colocated"]["lone_gap_s"] == pytest.approx(0.01)
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup", "-1"])


def test_a_sweeps_probe_records_land_in_the_json_beside_the_main_runs(monkeypatch, tmp_path):
    parser = _on_a_fake_server(monkeypatch, _all_attain)
    out = tmp_path / "out.json"
    args = parser.parse_args(
        ["--address", "x", "--policy", "flex", "--num-requests", "3", "--sweep-rate",
         "--sweep-rates", "0.5,1", "--json", str(out)]
    )  # fmt: skip
    assert cli.run(args) == 0
    doc = json.loads(out.read_text())
    assert len(doc["requests"]) == 3  # the main run's, as before
    assert [(r["policy"], r["probe_rate"]) for r in doc["probe_requests"]] == [
        ("flex", 0.5)
    ] * 3 + [("flex", 1.0)] * 3


def test_bench_server_takes_the_ports_its_log_names(tmp_path):
    """The bench's server binds ports of its own choosing (--port 0) and the bench reads them
    from its log: a port picked by the bench and bound later could be taken in between."""
    log = tmp_path / "serve.log"
    server = ServerProcess.__new__(ServerProcess)
    server.log_path, server.port, server.admin_port = log, 0, 0
    with pytest.raises(RuntimeError, match="wait_ready"):
        _ = server.address
    log.write_text("x router.server admin service (operators only) on 127.0.0.1:41234\n")
    assert not server._ports_from_log()  # not listening yet
    with log.open("a") as f:
        f.write(
            "x router.server pdserve listening on 127.0.0.1:41233 (plaintext; 1 prefill, ...)\n"
        )
    assert server._ports_from_log()
    assert server.address == "127.0.0.1:41233" and server.admin_address == "127.0.0.1:41234"
    assert server.metrics_address is None  # a server without metrics: runs measured without
    log.write_text("x router.server metrics on http://127.0.0.1:41235/metrics\n" + log.read_text())
    assert server._ports_from_log() and server.metrics_address == "127.0.0.1:41235"


def test_a_runs_busy_share_is_each_workers_step_seconds_over_its_wall_time():
    before = {"prefill-0": 10.0, "decode-0": 4.0}
    after = {"prefill-0": 15.0, "decode-0": 24.5, "decode-1": 3.0}  # decode-1: new meanwhile
    assert session.busy_share(before, after, 20.0) == {"prefill-0": 0.25, "decode-0": 1.0}
    assert session.busy_share(None, after, 20.0) is None
    assert session.busy_share(before, after, 0.0) is None
    # A count that went down (the server started afresh between the reads) gives no share.
    assert session.busy_share(before, {"prefill-0": 2.0}, 20.0) == {}
    assert session.busy_seconds(None) is None
    assert session.busy_seconds("127.0.0.1:1") is None  # nothing listens: measured without


def test_a_running_server_without_a_policy_is_labelled_as_itself(monkeypatch, tmp_path, capsys):
    """Against --address the bench sets no policy: without --policy the run is "server", not
    the first policy of the list, and no ratio to a fixed policy is claimed for it."""

    parser = _on_a_fake_server(monkeypatch, _all_attain)
    out = tmp_path / "out.json"
    assert cli.run(parser.parse_args(["--address", "x", "--num-requests", "3",
                                      "--json", str(out)])) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert list(doc["policies"]) == ["server"]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("server "))
    assert row.split()[-2] == "-"  # vs best fixed: none ran (not "1.00x" against itself)
    assert {x["policy"] for x in doc["requests"]} == {"server"}


def test_a_running_servers_metrics_address_gives_its_workers_busy_shares(
    monkeypatch, tmp_path, capsys
):
    parser = _on_a_fake_server(monkeypatch, _all_attain)
    reads = iter([{"prefill-0": 1.0, "decode-0": 2.0}, {"prefill-0": 4.0, "decode-0": 11.5}])
    asked = []

    def busy_seconds(address):
        asked.append(address)
        return next(reads)

    monkeypatch.setattr(session, "busy_seconds", busy_seconds)
    out = tmp_path / "out.json"
    args = ["--address", "x", "--metrics-address", "127.0.0.1:9400", "--num-requests", "3"]
    assert cli.run(parser.parse_args([*args, "--json", str(out)])) == 0
    assert asked == ["127.0.0.1:9400"] * 2  # just before the run and just after (10 s)
    busy = json.loads(out.read_text())["policies"]["server"]["busy"]
    assert busy == pytest.approx({"prefill-0": 0.3, "decode-0": 0.95})
    # Without --address there is no running server to read; --overload measures no trace.
    assert cli.run(parser.parse_args(["--metrics-address", "127.0.0.1:9400"])) == 2
    overload = ["--address", "x", "--overload", "2", "--metrics-address", "127.0.0.1:9400"]
    assert cli.run(parser.parse_args(overload)) == 2
    assert "--metrics-address" in capsys.readouterr().err
    # An address with nothing to read there is named, and the run goes on without.
    monkeypatch.setattr(session, "busy_seconds", lambda address: None)
    assert cli.run(parser.parse_args([*args, "--json", str(out)])) == 0
    assert "warning: --metrics-address 127.0.0.1:9400" in capsys.readouterr().out
    assert json.loads(out.read_text())["policies"]["server"]["busy"] is None


def test_the_bench_prints_and_keeps_each_policys_predictions(monkeypatch, tmp_path, capsys):
    def fake_run(address, reqs, rate, vocab, args, label, objective=None, seed=None):
        # Gaps of 150 ms where 75 were predicted, past the 100 ms SLO: misses unforeseen.
        res = [_result(0.2, [0.15] * 4) for _ in reqs]
        for r in res:
            r.path, r.predicted_ttft_s, r.predicted_itl_p99_s = "disaggregated", 0.2, 0.075
        return res, 10.0

    parser = _on_a_fake_server(monkeypatch, fake_run)
    out = tmp_path / "out.json"
    args = ["--address", "x", "--policy", "flex", "--num-requests", "3", "--json", str(out)]
    assert cli.run(parser.parse_args(args)) == 0
    kept = json.loads(out.read_text())["policies"]["flex"]["predictions"]
    assert kept["handoff"]["requests"] == 3
    assert kept["handoff"]["itl_p99_ratio"]["p50"] == pytest.approx(2.0)
    assert kept["handoff"]["itl_misses"] == {"foreseen": 0, "unforeseen": 3, "false_alarms": 0}
    printed = capsys.readouterr().out
    assert "predictions against measured" in printed
    row = next(ln for ln in printed.splitlines() if ln.startswith("flex ") and "handoff" in ln)
    assert row.split()[2:5] == ["3", "1.00", "1.00"]  # n, TTFT measured over predicted p50, p90


def test_a_runs_json_says_how_it_was_made(monkeypatch, tmp_path):
    """The command line, the commit of the checkout the bench ran from (and whether tracked
    files differed from it), the host and the start, beside the figures."""
    monkeypatch.setattr(sys, "argv", ["/some/venv/bin/pdserve", "bench", "--rate", "1 2"])
    parser = _on_a_fake_server(monkeypatch, _all_attain)
    out = tmp_path / "out.json"
    assert cli.run(parser.parse_args(["--address", "x", "--num-requests", "2",
                                      "--json", str(out)])) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["command"] == "pdserve bench --rate '1 2'"
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(cli.__file__).parent,
                          capture_output=True, text=True)  # fmt: skip
    assert doc["commit"] == (here.stdout.strip() if here.returncode == 0 else None)
    assert doc["changed"] in ((True, False) if doc["commit"] else (None,))
    assert doc["host"]["cpus"] == os.cpu_count() and doc["started"].endswith("+00:00")
