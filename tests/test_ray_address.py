"""A --ray-address that does not answer fails at once, naming it (Ray itself retries for
minutes, deaf to Ctrl-C)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from router.ray_runtime import RayUnavailable, _check_reachable


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_serve_at_an_address_nothing_listens_on_exits_2_naming_it():
    address = f"127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--model", "tiny-llama",
         "--ray-address", address, "--metrics-port", "-1", "--admin-port", "-1"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"could not reach the Ray cluster at {address!r}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - t0 < 90  # the imports and the tokenizer, then 5 s at most


def test_an_address_that_does_not_answer_in_time_is_named(monkeypatch):
    def silent(*args, **kwargs):
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(RayUnavailable, match=r"10\.9\.8\.7:6379' \(no answer within 5 s\)"):
        _check_reachable("10.9.8.7:6379")


def test_auto_and_client_addresses_are_left_to_ray(monkeypatch):
    def unreachable(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    _check_reachable("auto")  # Ray finds it (RAY_ADDRESS, its record, a local GCS)
    _check_reachable("ray://head:10001")


def test_a_private_runtime_that_fails_to_start_is_one_error(monkeypatch):
    """Ray's own failure to start a private runtime (a bare Exception: "The current node timed
    out during startup", on a loaded machine) is RayUnavailable, which serve prints as one
    line; SIGTERM, blocked while the runtime's processes start, is unblocked again."""
    import signal

    import ray

    from router import ray_runtime

    def fails(*args, **kwargs):
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fails)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with pytest.raises(RayUnavailable, match="could not start a private Ray runtime: The cur"):
        ray_runtime.init_ray(ray_runtime.LOCAL)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


class _Node:
    """A stand-in for Ray's node object: what its shutdown calls, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.all_processes: dict = {}

    def _kill_process_type(self, process_type, allow_graceful=False, check_alive=True, wait=False):
        self.calls.append((process_type, allow_graceful))

    def kill_all_processes(self, check_alive=True, allow_graceful=False, wait=False):
        self.calls.append(("all", allow_graceful))


def test_a_private_runtime_s_shutdown_ends_the_raylet_first_and_gives_no_process_a_grace(
    monkeypatch,
):
    """Its processes start with SIGTERM blocked, so the second Ray's shutdown waits after each
    SIGTERM would only be lost: the raylet ends first, its agents are waited for (they tell
    the GCS of its end), then the rest, each with SIGKILL at once."""
    from router import ray_runtime

    waited: list[float] = []
    monkeypatch.setattr(
        ray_runtime, "_wait_ended", lambda procs, timeout_s: waited.append(timeout_s)
    )
    node = _Node()
    ray_runtime._without_grace(node)
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=False)  # as Ray calls it
    assert node.calls == [("raylet", False), ("all", False)]
    assert waited == [ray_runtime.AGENTS_EXIT_S]


def test_a_node_whose_calls_fail_is_shut_down_ray_s_own_way():
    from router import ray_runtime

    class Changed(_Node):
        def _kill_process_type(self, process_type, **kwargs):
            raise TypeError("an argument this Ray does not take")

    node = Changed()
    ray_runtime._without_grace(node)
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=False)
    assert node.calls == [("all", True)]


def test_a_node_without_the_methods_keeps_ray_s_own_shutdown():
    from router import ray_runtime

    node = object()
    ray_runtime._without_grace(node)  # nothing to change, nothing raised
    ray_runtime._without_grace(None)


def test_a_process_that_exited_is_not_waited_for_though_not_yet_reaped():
    """A zombie (exited, its parent not yet told) has ended; a running process is waited for
    until the timeout."""
    import psutil

    from router.ray_runtime import _wait_ended

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(ended.pid).status() != psutil.STATUS_ZOMBIE:  # not reaped: ours
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        _wait_ended([psutil.Process(ended.pid)], 10)
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        _wait_ended([psutil.Process(ended.pid), psutil.Process(running.pid)], 0.3)
        assert time.monotonic() - t0 >= 0.3
    finally:
        running.kill()
        running.wait(10)
        ended.wait(10)


def test_the_ray_installed_has_the_node_methods_a_private_runtime_s_shutdown_calls():
    """What _without_grace calls on Ray's node, by the keywords it passes (a Ray whose node
    differs would shut down its own, slower way, which this says)."""
    import inspect

    from ray._private.node import Node

    kill_all = inspect.signature(Node.kill_all_processes).parameters
    kill_type = inspect.signature(Node._kill_process_type).parameters
    assert {"check_alive", "allow_graceful", "wait"} <= set(kill_all)
    assert {"process_type", "allow_graceful", "check_alive", "wait"} <= set(kill_type)
