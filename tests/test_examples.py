"""examples/cluster_demo.py (README, "A local cluster") runs as written and prints the same
completion through both paths."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_cluster_demo_prints_the_same_text_through_both_paths():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cluster_demo.py"), "--model", "tiny-llama"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[colocated] " in out.stdout and "[disaggregated] " in out.stdout, out.stdout
    after = out.stdout.split("[colocated] ", 1)[1]
    colocated, disaggregated = after.split("[disaggregated] ", 1)
    assert colocated.strip() and colocated == disaggregated, out.stdout
