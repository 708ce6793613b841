"""Where the host's CPU went over a bench run (bench/host_cpu.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil
import pytest

from bench import host_cpu
from bench.host_cpu import BENCH, ELSEWHERE, IDLE, RAY, Reading, Usage


def test_cores_per_process_from_two_readings():
    before = Reading(
        at_s=100.0,
        processes={
            10: Usage(1.0, 5.0),
            11: Usage(1.0, 2.0),
            12: Usage(1.0, 1.0),
            13: Usage(1.0, 7.0),
            15: Usage(1.0, 9.0),
        },  # fmt: skip
        names={10: "router", 11: "decode-0", 16: "prefill-0"},
        bench_s=3.0,
        host_busy_s=50.0,
        host_idle_s=30.0,
    )
    after = Reading(
        at_s=110.0,  # 10 s later
        # router +2 s, decode-0 +9.5 s, pid 12 (Ray's) +0.5 s, pid 13 ended, pid 14 started
        # (counted from zero), pid 15 another process under the same pid (from zero), and the
        # create time of pid 12 read 0.4 s off (a clock slew: the same process).
        processes={
            10: Usage(1.0, 7.0),
            11: Usage(1.0, 11.5),
            12: Usage(1.4, 1.5),
            14: Usage(5.0, 1.0),
            15: Usage(50.0, 0.5),
            16: Usage(1.0, 0.3),
        },  # fmt: skip
        names={10: "router", 11: "decode-0"},  # prefill-0 (16) not listed now: its name stays
        bench_s=4.0,
        host_busy_s=66.5,
        host_idle_s=33.5,
    )
    c = host_cpu.cores(before, after)
    assert c["router"] == pytest.approx(0.2)
    assert c["decode-0"] == pytest.approx(0.95)
    assert c["prefill-0"] == pytest.approx(0.03)  # started between the readings: from zero
    assert c[RAY] == pytest.approx(0.2)  # pids 12, 14 and 15: 0.5 + 1.0 + 0.5 s
    assert c[BENCH] == pytest.approx(0.1)
    assert c[ELSEWHERE] == pytest.approx((16.5 - 13.8 - 1.0) / 10)
    assert c[IDLE] == pytest.approx(0.35)
    assert sum(c.values()) == pytest.approx(2.0)  # every core's time, once
    assert host_cpu.cores(before, before) == {}  # readings too close for figures
    line = host_cpu.line({"split": c})
    assert line.startswith("split decode-0 0.95, prefill-0 0.03, router 0.20, ray 0.20, bench 0.10")


@pytest.fixture
def spinning_tree():
    """A shell (the root of a tree) whose child spins on a core until killed: (root, child)."""
    spin = "while True: pass"
    root = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{spin}" & wait'])
    kids: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 10
        while not (kids := psutil.Process(root.pid).children()):
            assert time.monotonic() < deadline, "the spinning child never started"
            time.sleep(0.05)
        yield root.pid, kids[0]
    finally:
        for k in kids:
            with contextlib.suppress(psutil.Error):
                k.kill()
        root.kill()
        root.wait(10)


def test_a_busy_process_in_the_tree_is_counted_under_its_name(spinning_tree):
    """A real tree: the spinning child's cores under its name, as its own CPU times give them;
    the shell's (next to none) under `ray`; every core of the host once."""
    root, child = spinning_tree
    pids = {"spinner": child.pid}
    t0 = child.cpu_times()
    before = host_cpu.read(pids, root)
    time.sleep(1.5)
    after = host_cpu.read(pids, root)
    t1 = child.cpu_times()
    c = host_cpu.cores(before, after)
    wall = after.at_s - before.at_s
    own = (t1.user + t1.system - t0.user - t0.system) / wall
    assert c["spinner"] == pytest.approx(own, abs=0.05) and c["spinner"] > 0.05
    assert c[RAY] < c["spinner"] / 5
    # Idle is read from the host's idle time, not what the rest leaves: the sum checks both.
    assert sum(c.values()) == pytest.approx(psutil.cpu_count(), abs=0.3)


def test_the_bench_counts_once_inside_the_tree_it_reads():
    """A tree with this process in it (the bench under the root): its seconds are the bench's
    only, and not the tree's too."""
    me = os.getpid()
    parent = psutil.Process(me).parent()
    assert parent is not None
    before = host_cpu.read({}, parent.pid)
    assert me not in before.processes and parent.pid in before.processes
    t = time.monotonic() + 1.2
    while time.monotonic() < t:  # busy here: the bench's, not Ray's
        pass
    c = host_cpu.cores(before, host_cpu.read({}, parent.pid))
    assert c[BENCH] > 0.05 and c[RAY] < c[BENCH] / 2  # counted twice, it would be as much
