"""Where the host's CPU went over a bench run (bench/host_cpu.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time

import grpc
import psutil
import pytest

from bench import host_cpu
from bench.host_cpu import BENCH, ELSEWHERE, IDLE, RAY, Reading, Usage
from bench.server import ServerProcess
from pdserve_proto import admin_pb2, admin_pb2_grpc


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


_INSIDE = """
import json, os, time
from bench import host_cpu
before = host_cpu.read({}, os.getppid())
t = time.monotonic() + 1.2
while time.monotonic() < t:
    pass
after = host_cpu.read({}, os.getppid())
print(json.dumps([os.getpid() in before.processes, host_cpu.cores(before, after)]))
"""


def test_the_bench_counts_once_inside_the_tree_it_reads(tmp_path):
    """A bench under the root of the tree it reads (a shell whose only child it is): its seconds
    are the bench's only, not the tree's too."""
    script = tmp_path / "inside.py"
    script.write_text(_INSIDE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(["bash", "-c", f'"{sys.executable}" "{script}"; exit $?'],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    in_tree, c = json.loads(out.stdout)
    assert not in_tree
    assert c[BENCH] > 0.05 and c[RAY] < c[BENCH] / 2  # counted twice, it would be as much


def test_a_server_names_only_its_ready_workers_on_this_host(tmp_path):
    """ServerProcess.pids: the router, and each ready worker whose node is this host (or not
    given); a worker on another node would name some other process here."""
    listing = admin_pb2.ListWorkersResponse(
        workers=[
            admin_pb2.Worker(worker_id="decode-0", status="ready", node_ip="127.0.0.1", pid=11),
            admin_pb2.Worker(worker_id="prefill-0", status="ready", node_ip="", pid=12),
            admin_pb2.Worker(worker_id="decode-1", status="ready", node_ip="192.0.2.7", pid=13),
            admin_pb2.Worker(worker_id="decode-2", status="draining", node_ip="127.0.0.1", pid=14),
            admin_pb2.Worker(worker_id="decode-3", status="starting", node_ip="127.0.0.1"),
        ]
    )

    class Admin(admin_pb2_grpc.AdminServicer):
        async def ListWorkers(self, request, context):
            return listing

    class Proc:
        pid = 10

    async def ask() -> dict[str, int]:
        server = grpc.aio.server()
        admin_pb2_grpc.add_AdminServicer_to_server(Admin(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            sp = ServerProcess.__new__(ServerProcess)
            sp.proc, sp.admin_port = Proc(), port  # type: ignore[assignment]
            return await asyncio.wait_for(sp.pids(), 10)
        finally:
            await server.stop(None)

    assert asyncio.run(ask()) == {"router": 10, "decode-0": 11, "prefill-0": 12}
