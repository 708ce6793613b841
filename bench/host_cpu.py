"""Where the host's CPU went over a run, in cores (CPU seconds over the run's wall seconds): each
worker's process, the router's, the rest of the server's process tree (Ray's own processes), the
bench itself (the load generator), the rest of the host, and what stood idle.

On a host that runs the whole deployment, a worker that is idle part of the time does not mean
spare CPU: the router, Ray and the client run on the same cores. Read with the workers' busy
shares (session.busy_share) to see which.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil

RAY = "ray"  # the rest of the server's process tree: Ray's daemons and idle worker processes
BENCH = "bench"
ELSEWHERE = "elsewhere"
IDLE = "idle"


@dataclass(frozen=True, slots=True)
class Reading:
    at_s: float  # time.monotonic()
    # CPU seconds (user + system) per process: (pid, create time) -> seconds, for the server's
    # tree, its named processes found in it by pid
    tree: dict[tuple[int, float], float]
    names: dict[int, str]  # pid -> name (the router, each worker)
    bench_s: float
    host_busy_s: float  # every CPU's seconds not idle, since boot
    cores: int


def _cpu_s(p: psutil.Process) -> tuple[tuple[int, float], float] | None:
    with contextlib.suppress(psutil.Error):
        with p.oneshot():
            t = p.cpu_times()
            return (p.pid, p.create_time()), t.user + t.system
    return None


def _host_busy_s() -> float:
    t = psutil.cpu_times()
    # Not busy: idle and waiting on I/O; counted twice: a guest's time is in user's already.
    left = ("idle", "iowait", "guest", "guest_nice")
    return sum(t) - sum(getattr(t, f, 0.0) for f in left)


def read(pids: dict[str, int], root: int | None) -> Reading:
    """The CPU seconds so far of `root`'s process tree (the server: the router and every process
    it started, Ray's and the workers'), of this process, and of the host. `pids`: names for some
    processes (`router`, each worker id), read too where they are not in the tree."""
    tree: dict[tuple[int, float], float] = {}
    if root is not None:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(root)
            for p in (top, *top.children(recursive=True)):
                got = _cpu_s(p)
                if got is not None:
                    tree[got[0]] = got[1]
    # A named process outside the tree (a worker on a Ray cluster the server joined) by itself.
    for pid in set(pids.values()) - {pid for pid, _ in tree}:
        with contextlib.suppress(psutil.Error):
            got = _cpu_s(psutil.Process(pid))
            if got is not None:
                tree[got[0]] = got[1]
    own = _cpu_s(psutil.Process(os.getpid()))
    return Reading(
        time.monotonic(),
        tree,
        {pid: name for name, pid in pids.items()},
        own[1] if own else 0.0,
        _host_busy_s(),
        psutil.cpu_count() or 1,
    )


def cores(before: Reading, after: Reading) -> dict[str, float]:
    """Cores used between two readings: per named process, `ray` for the rest of the tree, the
    `bench`, `elsewhere` on the host, and `idle` (of the host's cores). A process started between
    them counts from zero; one that ended is lost (its seconds appear nowhere but `elsewhere`)."""
    wall = after.at_s - before.at_s
    if wall <= 0:
        return {}
    used: dict[str, float] = {}
    tree = 0.0
    for key, s in after.tree.items():
        grew = max(0.0, s - before.tree.get(key, 0.0))
        tree += grew
        name = after.names.get(key[0])
        if name is not None:
            used[name] = used.get(name, 0.0) + grew
    used[RAY] = tree - sum(used.values())
    used[BENCH] = max(0.0, after.bench_s - before.bench_s)
    busy = max(0.0, after.host_busy_s - before.host_busy_s)
    used[ELSEWHERE] = max(0.0, busy - tree - used[BENCH])
    used[IDLE] = max(0.0, after.cores * wall - busy)
    return {k: v / wall for k, v in used.items()}


def line(by_policy: dict[str, dict[str, float]]) -> str:
    """One line for the table: each policy's cores per process, workers first."""
    fixed = ("router", RAY, BENCH, ELSEWHERE, IDLE)

    def one(c: dict[str, float]) -> str:
        workers = sorted(k for k in c if k not in fixed)
        return ", ".join(f"{k} {c[k]:.2f}" for k in (*workers, *fixed) if k in c)

    return "; ".join(f"{p} {one(c)}" for p, c in by_policy.items())
