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
from pathlib import Path

import ray

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
    # ray.shutdown() ends each with SIGKILL once its SIGTERM has gone unheard for 1 s.
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
    return LOCAL
