"""Which Ray runtime pdserve runs on, chosen once per process by `--ray-address`:

  HOST:PORT  join that cluster (from any machine that reaches it);
  auto       join the cluster this machine is part of (`ray start` ran here: a head node);
  local      start a private Ray on this machine, every socket on 127.0.0.1;
  (none)     the RAY_ADDRESS variable if set; else the runtime `ray start` left running on this
             machine, if one answers (said in one line); else the same as `local`.

Call `init_ray` from a thread that lives as long as the process (the main thread): Ray's own
processes are told to die with the thread that started them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import ray
import ray._private.ray_constants as ray_constants

log = logging.getLogger("pdserve.ray")
LOCAL = "local"
AUTO = "auto"


class RayUnavailable(RuntimeError):
    """The Ray runtime asked for cannot be reached or started."""


def _ray_temp_dir() -> Path:
    """Where `ray start` records the address of the runtime it started on this machine
    (RAY_TMPDIR, else TMPDIR on Linux, else /tmp, then ray/)."""
    base = os.environ.get("RAY_TMPDIR")
    if not base and sys.platform.startswith("linux"):
        base = os.environ.get("TMPDIR")
    return Path(base or "/tmp") / "ray"


def running_runtime(timeout_s: float = 1.0) -> str | None:
    """The address of a Ray runtime `ray start` left running on this machine, if it answers."""
    try:
        address = (_ray_temp_dir() / "ray_current_cluster").read_text().strip()
    except OSError:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return address
    except OSError:
        return None  # a stale record: that runtime is gone


AGENTS_EXIT_S = 5.0  # for what the raylet started to end after it, at a private runtime's end
REACH_TIMEOUT_S = 5.0  # for a cluster's address to accept a connection


def _check_reachable(address: str) -> None:
    """Fail at once, naming the address, where Ray would retry for minutes (deaf to Ctrl-C): a
    HOST:PORT that does not accept a connection within REACH_TIMEOUT_S. (`auto` and a ray://
    client address are left to Ray: it finds `auto` in more places than this could check.)"""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S):
            return
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
    raise RayUnavailable(
        f"could not reach the Ray cluster at {address!r} ({why} within {REACH_TIMEOUT_S:g} s). "
        "Check the address and that `ray status` works on a node of that cluster, or pass "
        "--ray-address local to start a private Ray"
    )


def init_ray(address: str | None) -> str:
    """Join or start Ray as `address` says (see the module docstring); returns the address
    joined, or "local". Raises RayUnavailable with what to do when it can't."""
    if ray.is_initialized():
        return address or LOCAL
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
    if address is None:
        found = running_runtime()
        if found is not None:
            log.info(
                "a Ray runtime is already running on this machine (%s): serving on it "
                "(--ray-address local starts a private one instead)",
                found,
            )
            address = found
    if address and address != LOCAL:
        _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailable(
                f"could not join the Ray cluster at {address!r}: {exc}. Check that `ray status` "
                "works on this machine, or pass --ray-address local to start a private Ray"
            ) from None
        return address
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (router/__init__.py) keeps this runtime on 127.0.0.1.
    # Its processes start in this process's group, where a SIGTERM to the group (systemd's,
    # `timeout`'s, `kill -- -PGID`) ended some of them while this one drained: they start with
    # SIGTERM blocked (as Ray blocks SIGINT there; the workers they start inherit it), and
    # ray.shutdown() ends each with SIGKILL (see _without_grace).
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        ray.init(
            address=LOCAL,
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    except Exception as exc:  # Ray's own: "The current node timed out during startup", ...
        raise RayUnavailable(f"could not start a private Ray runtime: {exc}") from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _without_grace(getattr(ray._private.worker, "_global_node", None))
    return LOCAL


def _without_grace(node: Any) -> None:
    """Have ray.shutdown() end the private runtime's processes with SIGKILL at once. Its
    default sends each a SIGTERM and waits a second before the SIGKILL; with SIGTERM blocked in
    them (init_ray) that second was never used, and cost the exit one second per process (five
    on this machine). The raylet's agents still get the GCS they tell of its end before they
    exit (killed with the GCS, they waited a minute for it, orphaned): the raylet ends first,
    then the processes it started are waited for (AGENTS_EXIT_S at most), then the rest end.
    A Ray whose node differs keeps its own way, as does one whose calls here fail."""
    kill_all = getattr(node, "kill_all_processes", None)
    kill_type = getattr(node, "_kill_process_type", None)
    if kill_all is None or kill_type is None:
        return

    def at_once(*args: Any, **kwargs: Any) -> Any:
        try:
            started = _children(node, ray_constants.PROCESS_TYPE_RAYLET)
            kill_type(ray_constants.PROCESS_TYPE_RAYLET, allow_graceful=False,
                      check_alive=False, wait=bool(kwargs.get("wait")))  # fmt: skip
            _wait_ended(started, AGENTS_EXIT_S)
        except Exception:
            log.debug("a private Ray's shutdown at once failed: Ray's own", exc_info=True)
            return kill_all(*args, **kwargs)
        return kill_all(*args, **{**kwargs, "allow_graceful": False})

    node.kill_all_processes = at_once


def _children(node: Any, process_type: str) -> list[psutil.Process]:
    """The processes the node's process of this type started (none where it has none)."""
    try:
        (info,) = node.all_processes[process_type]
        return psutil.Process(info.process.pid).children()
    except Exception:
        return []


def _wait_ended(procs: list[psutil.Process], timeout_s: float) -> None:
    """Until every one of `procs` has exited (a zombie has: its parent is gone, and it waits
    only for the init process to reap it), or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while any(map(_running, procs)) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
