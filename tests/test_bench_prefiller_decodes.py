"""bench.prefiller_decodes, end to end on the tiny model: two engine processes, one run."""

from __future__ import annotations

import json
import math

import pytest

from bench import prefiller_decodes


def test_a_run_reports_the_prefillers_decodes_and_the_decode_workers_steps(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--model", "tiny-llama", "--runs", "2:50", "--duration", "4", "--warmup", "2",
            "--startup", "10", "--output-len", "16", "--decode-batch", "2", "--rate", "4",
            "--json", str(out)]  # fmt: skip
    assert prefiller_decodes.main(argv) == 0
    doc = json.loads(out.read_text())
    assert list(doc)[:2] == ["command", "commit"] and doc["args"]["rate"] == 4
    (row,) = doc["rows"]
    assert row["every"] == 2 and row["target_ms"] == 50 and row["sent"] >= 4
    # Every other request decoded there, each timed over its gaps; the handoffs' TTFTs too.
    assert 1 <= row["local_decodes"] <= (row["sent"] + 1) // 2
    assert row["local_p99_gap_ms"] > 0 and 0 <= row["local_over_slo"] <= row["local_decodes"]
    assert 0 < row["ttft_p50_s"] <= row["ttft_max_s"]
    assert math.isfinite(row["slowdown"]) and row["slowdown"] > 0
    printed = capsys.readouterr().out
    assert "1 in 2" in printed and "over 123 ms" in printed


def test_a_run_that_is_not_every_target_ms_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        prefiller_decodes.main(["--runs", "4"])
    assert "--runs" in capsys.readouterr().err
