"""Where the host's CPU went over a run, in cores (CPU seconds over the seconds between two
readings): each worker's process, the router's, the rest of the server's process tree (Ray's own
processes, where the router started Ray), the bench itself (the load generator), the rest of the
host, and what stood idle.

On a host that runs the whole deployment, a worker that is idle part of the time does not mean
spare CPU: the router, Ray and the client run on the same cores. Read with the workers' busy
shares (session.busy_share) to see which; those count from the first request sent to the last
answer, these from just before the run's prompts are built to just after its last answer.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import psutil

RAY = "ray"  # the rest of the server's process tree: Ray's daemons and idle worker processes
BENCH = "bench"
ELSEWHERE = "elsewhere"  # the rest of the host, interrupts and a hypervisor's steal included
IDLE = "idle"
SHORTEST_S = 0.2  # readings closer than this give no figures: CPU time is counted in 10 ms ticks
SAME_START_S = 1.0  # a pid whose start moved less than this is the same process (clock slews)


class Usage(NamedTuple):
    started: float  # its create time (seconds since the epoch)
    cpu_s: float  # user + system


@dataclass(frozen=True, slots=True)
class Reading:
    at_s: float  # time.monotonic()
    processes: dict[int, Usage]  # the server's tree, and its named processes outside it
    names: dict[int, str]  # pid -> name (the router, each worker)
    bench_s: float
    host_busy_s: float  # every CPU's seconds not idle, since boot
    host_idle_s: float  # every CPU's seconds idle or waiting on I/O, since boot


def _usage(p: psutil.Process) -> Usage | None:
    with contextlib.suppress(psutil.Error):
        with p.oneshot():
            t = p.cpu_times()
            return Usage(p.create_time(), t.user + t.system)
    return None


def read(pids: dict[str, int], root: int | None) -> Reading:
    """The CPU seconds so far of `root`'s process tree (the server: the router and every process
    it started, Ray's and the workers'), of this process, and of the host. `pids`: names for some
    processes (`router`, each worker id), read too where they are not in the tree. This process
    counts as the bench only, in the tree or not."""
    found: list[psutil.Process] = []
    if root is not None:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(root)
            found = [top, *top.children(recursive=True)]
    outside = set(pids.values()) - {p.pid for p in found}
    for pid in outside:  # a worker the router reaches on a Ray it joined, on this host
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    me = os.getpid()
    processes = {p.pid: u for p in found if p.pid != me and (u := _usage(p)) is not None}
    own = _usage(psutil.Process(me))
    t = psutil.cpu_times()
    # Idle: idle and waiting on I/O. A guest's time is counted in user's already.
    idle = t.idle + getattr(t, "iowait", 0.0)
    twice = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return Reading(
        time.monotonic(),
        processes,
        {pid: name for name, pid in pids.items()},
        own.cpu_s if own else 0.0,
        sum(t) - idle - twice,
        idle,
    )


def cores(before: Reading, after: Reading) -> dict[str, float]:
    """Cores used between two readings: per named process, `ray` for the rest of the tree, the
    `bench`, `elsewhere` on the host, and `idle`. A process started between them counts from
    zero; one that ended is lost (its seconds count `elsewhere`). Empty for readings under
    SHORTEST_S apart."""
    wall = after.at_s - before.at_s
    if wall < SHORTEST_S:
        return {}
    names = {**before.names, **after.names}  # a worker listed at one reading only keeps its name
    used: dict[str, float] = {}
    tree = 0.0
    for pid, now in after.processes.items():
        was = before.processes.get(pid)
        same = was is not None and abs(was.started - now.started) < SAME_START_S
        grew = max(0.0, now.cpu_s - was.cpu_s) if same and was is not None else now.cpu_s
        tree += grew
        if (name := names.get(pid)) is not None:
            used[name] = used.get(name, 0.0) + grew
    used[RAY] = max(0.0, tree - sum(used.values()))
    used[BENCH] = max(0.0, after.bench_s - before.bench_s)
    busy = max(0.0, after.host_busy_s - before.host_busy_s)
    used[ELSEWHERE] = max(0.0, busy - tree - used[BENCH])
    used[IDLE] = max(0.0, after.host_idle_s - before.host_idle_s)
    return {k: v / wall for k, v in used.items()}


def line(by_policy: dict[str, dict[str, float]]) -> str:
    """One line for the table: each policy's cores per process, workers first."""
    fixed = ("router", RAY, BENCH, ELSEWHERE, IDLE)

    def one(c: dict[str, float]) -> str:
        workers = sorted(k for k in c if k not in fixed)
        return ", ".join(f"{k} {c[k]:.2f}" for k in (*workers, *fixed) if k in c)

    return "; ".join(f"{p} {one(c)}" for p, c in by_policy.items())
