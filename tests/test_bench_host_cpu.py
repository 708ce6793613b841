"""Where the host's CPU went over a bench run (bench/host_cpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from bench import host_cpu
from bench.host_cpu import BENCH, ELSEWHERE, IDLE, RAY, Reading


def test_cores_per_process_from_two_readings():
    before = Reading(
        at_s=100.0,
        tree={(10, 1.0): 5.0, (11, 1.0): 2.0, (12, 1.0): 1.0, (13, 1.0): 7.0},
        names={10: "router", 11: "decode-0"},
        bench_s=3.0,
        host_busy_s=50.0,
        cores=2,
    )
    after = Reading(
        at_s=110.0,  # 10 s later
        # router +2 s, decode-0 +9.5 s, pid 12 (Ray's) +0.5 s, pid 13 ended, pid 14 started
        # (counted from zero).
        tree={(10, 1.0): 7.0, (11, 1.0): 11.5, (12, 1.0): 1.5, (14, 5.0): 1.0},
        names={10: "router", 11: "decode-0"},
        bench_s=4.0,
        host_busy_s=66.0,
        cores=2,
    )
    c = host_cpu.cores(before, after)
    assert c["router"] == pytest.approx(0.2)
    assert c["decode-0"] == pytest.approx(0.95)
    assert c[RAY] == pytest.approx(0.15)  # pids 12 and 14
    assert c[BENCH] == pytest.approx(0.1)
    assert c[ELSEWHERE] == pytest.approx((16.0 - 13.0 - 1.0) / 10)
    assert c[IDLE] == pytest.approx((20.0 - 16.0) / 10)
    assert sum(c.values()) == pytest.approx(2.0)  # every core's time, once
    assert host_cpu.cores(after, after) == {}  # no time between them
    line = host_cpu.line({"split": c})
    assert line.startswith("split decode-0 0.95, router 0.20, ray 0.15, bench 0.10")


def test_a_busy_process_in_the_tree_is_counted_under_its_name():
    """A real tree: a shell (the root) whose child spins; the child's cores under its name, the
    shell's (next to none) under `ray`, and every core accounted for once."""
    spin = "import time\nt = time.time() + 4\nwhile time.time() < t: pass"
    root = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{spin}" & wait'])
    try:
        deadline = time.monotonic() + 10
        while not (kids := psutil.Process(root.pid).children()):
            assert time.monotonic() < deadline, "the spinning child never started"
            time.sleep(0.05)
        pids = {"spinner": kids[0].pid}
        before = host_cpu.read(pids, root.pid)
        time.sleep(1.0)
        after = host_cpu.read(pids, root.pid)
    finally:
        root.kill()
        root.wait(10)
        for k in kids:
            k.kill()
    c = host_cpu.cores(before, after)
    assert c["spinner"] > 0.3  # one core at most, less on a host this busy
    assert c[RAY] < 0.2
    assert sum(c.values()) == pytest.approx(psutil.cpu_count(), abs=0.3)
    assert after.cores == psutil.cpu_count() and before.bench_s > 0
    assert os.getpid() not in after.names
