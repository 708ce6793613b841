"""scripts/prefiller_decodes.py end to end on the tiny model: two engine processes, one run."""

from __future__ import annotations

import json
import math

import pytest

from scripts import prefiller_decodes


def test_a_run_reports_the_prefillers_decodes_and_the_decode_workers_steps(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--model", "tiny-llama", "--runs", "2:50", "--duration", "4", "--warmup", "2",
            "--output-len", "16", "--decode-batch", "2", "--rate", "4",
            "--json", str(out)]  # fmt: skip
    assert prefiller_decodes.main(argv) == 0
    doc = json.loads(out.read_text())
    assert list(doc)[:2] == ["command", "commit"] and doc["args"]["rate"] == 4
    (row,) = doc["rows"]
    assert row["every"] == 2 and row["target_ms"] == 50 and row["sent"] >= 4
    # Every other request sent was to decode there; each finished one timed over its gaps.
    assert row["decoded_there"] == (row["sent"] + 1) // 2
    assert 1 <= row["finished"] <= row["decoded_there"] and row["p99_gap_ms"] > 0
    assert row["decoded_there"] - row["finished"] <= row["over_slo"] <= row["decoded_there"]
    assert 1 <= row["served"] <= row["sent"] and 0 < row["ttft_p50_s"] <= row["ttft_max_s"]
    # The decode worker's steps, alone and while the other ran steps, were both timed.
    assert row["step_alone_ms"] > 0 and math.isfinite(row["slowdown"]) and row["slowdown"] > 0
    printed = capsys.readouterr().out
    assert "1 in 2" in printed and "miss 124 ms" in printed


def test_a_run_that_is_not_every_target_ms_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        prefiller_decodes.main(["--runs", "4"])
    assert "--runs" in capsys.readouterr().err
