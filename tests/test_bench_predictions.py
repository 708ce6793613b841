"""The bench's predictions against measured values (bench/predictions.py), alone and from a
saved run's JSON (the bench's own table: tests/test_bench.py)."""

from __future__ import annotations

import json

import pytest

from bench import predictions, slo
from bench.loadgen import RequestResult

OBJECTIVE = slo.Slo(ttft_s=1.0, itl_s=0.1)


def _served(path, ttft, gap, predicted_ttft, predicted_gap, status="OK", n=21):
    """A request served with `n` tokens a `gap` apart after `ttft`, and what was predicted."""
    times = [ttft + i * gap for i in range(n)]
    r = RequestResult(0, 10, n, 0.0, ttft, times, times[-1], n, status, path=path)
    r.predicted_ttft_s, r.predicted_itl_p99_s = predicted_ttft, predicted_gap
    return r.to_json()


def test_each_request_served_is_judged_against_its_placements_prediction():
    requests = [
        # colocated: TTFT twice the prediction, past the SLO unforeseen; gap as predicted.
        _served("colocated", 1.2, 0.05, 0.6, 0.05),
        # handoff: TTFT as foretold; a p99 gap past the SLO, foreseen.
        _served("disaggregated", 0.4, 0.15, 0.4, 0.12),
        # handoff: a gap predicted past the SLO that met it (a false alarm), TTFT half.
        _served("disaggregated", 0.2, 0.08, 0.4, 0.16),
        # left out: failed, refused, or told no prediction.
        _served("disaggregated", 0.2, 0.08, 0.4, 0.16, status="CANCELLED"),
        _served("disaggregated", 0.2, 0.08, 0.4, 0.16, n=10) | {"output_len": 21},
        _served("disaggregated", 0.2, 0.08, None, None),
    ]
    acc = predictions.accuracy(requests, OBJECTIVE)
    assert set(acc) == {"all", "colocated", "handoff"}
    assert [acc[k]["requests"] for k in ("all", "colocated", "handoff")] == [3, 1, 2]
    assert acc["colocated"]["ttft_ratio"]["p50"] == pytest.approx(2.0)
    assert acc["colocated"]["itl_p99_ratio"]["p50"] == pytest.approx(1.0)
    assert acc["colocated"]["ttft_misses"] == {"foreseen": 0, "unforeseen": 1, "false_alarms": 0}
    assert acc["handoff"]["ttft_ratio"]["p50"] == pytest.approx(0.75)  # 1.0 and 0.5
    assert acc["handoff"]["itl_p99_ratio"]["p50"] == pytest.approx((1.25 + 0.5) / 2)
    assert acc["handoff"]["itl_misses"] == {"foreseen": 1, "unforeseen": 0, "false_alarms": 1}
    assert acc["all"]["itl_misses"] == {"foreseen": 1, "unforeseen": 0, "false_alarms": 1}
    assert acc["all"]["ttft_misses"]["unforeseen"] == 1
    # A run that served nothing with a prediction has no ratios and no misses.
    none = predictions.accuracy(requests[3:], OBJECTIVE)
    assert list(none) == ["all"] and none["all"]["requests"] == 0
    assert none["all"]["ttft_ratio"]["p50"] is None


def test_edges_a_tpot_slo_one_token_a_fallback_and_an_unknown_path():
    one_token = _served("disaggregated", 0.5, 0.05, 0.5, 0.05, n=1)
    fell_back = _served("disaggregated", 2.0, 0.05, 0.5, 0.05) | {"kv_fallback": "timeout"}
    unknown = _served("", 0.5, 0.2, 0.5, 0.05)
    # At the limit is no miss, either way (an ITL SLO of 125 ms: gaps exact in binary).
    at_limit = _served("colocated", 1.0, 0.125, 1.0, 0.125)
    acc = predictions.accuracy([one_token, fell_back, unknown, at_limit], slo.Slo(1.0, 0.125))
    assert acc["all"]["requests"] == 4 and acc["all"]["with_gaps"] == 3
    assert acc["handoff"]["requests"] == 2 and acc["handoff"]["kv_fallbacks"] == 1
    assert acc["colocated"]["ttft_misses"] == acc["colocated"]["itl_misses"] == {
        "foreseen": 0, "unforeseen": 0, "false_alarms": 0
    }  # fmt: skip
    assert acc["all"]["itl_misses"]["unforeseen"] == 1  # the unknown path's, in `all` only
    # Where the SLO judges TPOT, the p99 gap the router predicts is not what misses it.
    tpot = predictions.accuracy([fell_back], slo.Slo(1.0, 0.1, "tpot"))
    assert tpot["all"]["itl_misses"] is None and tpot["all"]["ttft_misses"]["unforeseen"] == 1


def test_a_saved_run_is_judged_per_policy_and_round(tmp_path, capsys):
    doc = {
        "slo": {"ttft_s": 1.0, "itl_s": 0.1, "itl_metric": "itl_p99"},
        "requests": [
            dict(_served("colocated", 0.5, 0.05, 0.5, 0.05), policy="flex", round=r) for r in (1, 2)
        ]
        + [dict(_served("disaggregated", 0.5, 0.2, 0.5, 0.05), policy="auto", round=2)],
    }
    rows = predictions.of_saved_run(doc)
    assert [label for label, _ in rows] == [
        "flex (round 1/2)", "auto (round 2/2)", "flex (round 2/2)"
    ]  # fmt: skip
    assert rows[1][1]["handoff"]["itl_misses"]["unforeseen"] == 1
    run = tmp_path / "run.json"
    run.write_text(json.dumps(doc))
    assert predictions.main([str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    auto = next(line for line in lines if line.startswith("auto (round 2/2)") and "handoff" in line)
    assert auto.split()[-1] == "0/1/0"  # ITL misses: foreseen/unforeseen/foreseen but met
    # An --overload run names its one policy once, at the top.
    overload = {"policy": "auto", "slo": doc["slo"], "requests": [doc["requests"][0]]}
    del overload["requests"][0]["policy"]
    assert [label for label, _ in predictions.of_saved_run(overload)] == ["auto"]
    predictions.report([])
    assert "no run to judge" in capsys.readouterr().out
    # A run without SLOs, or no run at all, is refused naming the file.
    run.write_text(json.dumps({"requests": []}))
    assert predictions.main([str(run)]) == 2
    assert predictions.main([str(tmp_path / "missing.json")]) == 2
    out = capsys.readouterr().out
    assert "run.json" in out and "no SLOs" in out and "missing.json" in out
