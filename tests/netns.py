"""Two Ray nodes on distinct addresses on one Linux machine: two network namespaces joined by a
veth pair (10.77.0.1 and 10.77.0.2), a Ray head in the first and a second node in the second,
each with a custom resource naming it ("node_a", "node_b"). Nothing leaves the two namespaces.

A socket bound to 127.0.0.1 on one node cannot be reached from the other here, as on a real
cluster; a cluster on one address would hide it. Needs root and iproute2; `available()` says
why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HEAD_IP, NODE_IP = "10.77.0.1", "10.77.0.2"
RAY_PORT = 6379
ROOT = Path(__file__).resolve().parent.parent


def available() -> str | None:
    """None when two namespaces can be made here, else why not."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name, veth = f"pdchk{os.getpid() % 100000}", f"pdck{os.getpid() % 100000}"
    try:
        for what, cmd in (
            ("a network namespace", ["ip", "netns", "add", name]),
            ("a veth pair", ["ip", "link", "add", veth, "type", "veth", "peer", veth + "b"]),
            ("a veth end in a namespace", ["ip", "link", "set", veth, "netns", name]),
        ):
            probe = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if probe.returncode != 0:
                return f"cannot create {what}: {probe.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "link", "del", veth + "b"], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def child_env() -> dict[str, str]:
    """The environment for processes in the namespaces: Ray must use the namespace's own
    address, so the test session's loopback-only settings are dropped."""
    env = dict(os.environ)
    for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_TMPDIR"):
        env.pop(k, None)
    env["RAY_AUTH_MODE"] = "disabled"
    env["PYTHONPATH"] = str(ROOT)
    return env


def pids(ns: str) -> list[int]:
    """The processes running in network namespace `ns`."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def remove(ns: str) -> None:
    """Kill every process in namespace `ns` (Ray's daemons included: `ray stop` would also stop
    the test session's own Ray), then remove it."""
    for _ in range(3):
        alive = pids(ns)
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def stop(server: subprocess.Popen[bytes]) -> None:
    """Stop a `pdserve serve` as Ctrl-C does (it drains, then exits); kill it if it hangs."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(10)


class TwoNodes:
    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.ns = (f"pdA{tag}", f"pdB{tag}")
        self.veth = (f"pdva{tag}", f"pdvb{tag}")  # the link's ends, in the first and the second
        self._tmp = Path(tempfile.mkdtemp(prefix="pdn"))
        self.head_address = f"{HEAD_IP}:{RAY_PORT}"
        # A process in the head's namespace with this environment finds the head's runtime the
        # way one on a head node does (`--ray-address auto`).
        self.head_env = {"RAY_TMPDIR": str(self._tmp / "a")}

    # -- setup and teardown ----------------------------------------------------------------------
    def __enter__(self) -> TwoNodes:
        try:
            self._link()
            ray = str(Path(sys.executable).parent / "ray")
            common = ["--num-cpus", "2", "--disable-usage-stats"]
            self.run(0, [ray, "start", "--head", "--node-ip-address", HEAD_IP, "--port",
                         str(RAY_PORT), "--resources", '{"node_a": 8}',
                         "--include-dashboard=false", *common],
                     env={"RAY_TMPDIR": str(self._tmp / "a")}, timeout=120)  # fmt: skip
            self.run(1, [ray, "start", "--address", self.head_address, "--node-ip-address",
                         NODE_IP, "--resources", '{"node_b": 8}', *common],
                     env={"RAY_TMPDIR": str(self._tmp / "b")}, timeout=120)  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _link(self) -> None:
        a, b = self.ns
        va, vb = self.veth
        for cmd in (
            ["ip", "netns", "add", a],
            ["ip", "netns", "add", b],
            ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
            ["ip", "link", "set", va, "netns", a],
            ["ip", "link", "set", vb, "netns", b],
            ["ip", "-n", a, "addr", "add", f"{HEAD_IP}/24", "dev", va],
            ["ip", "-n", b, "addr", "add", f"{NODE_IP}/24", "dev", vb],
            ["ip", "-n", a, "link", "set", "lo", "up"],
            ["ip", "-n", b, "link", "set", "lo", "up"],
            ["ip", "-n", a, "link", "set", va, "up"],
            ["ip", "-n", b, "link", "set", vb, "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def close(self) -> None:
        for ns in self.ns:
            remove(ns)
        shutil.rmtree(self._tmp, ignore_errors=True)

    # -- running things in a namespace -----------------------------------------------------------
    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node], *argv]

    def run(
        self, node: int, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            self.command(node, argv), env={**child_env(), **(env or {})}, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr[-2000:]}")
        return out

    def start(
        self, node: int, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(log, "wb") as f:
            return subprocess.Popen(
                self.command(node, argv), env={**child_env(), **(env or {})}, stdout=f,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip


class LoneNode:
    """One network namespace with only its loopback, and a Ray head started in it by `ray start`
    (on 127.0.0.1 there), as a user leaves one running on a machine. Its address is recorded
    under `ray_tmpdir`, where `ray start` writes it for later `ray.init()` calls to find."""

    def __init__(self) -> None:
        self.ns = f"pdC{os.getpid() % 100000}"
        self.ray_tmpdir = Path(tempfile.mkdtemp(prefix="pdn"))

    def __enter__(self) -> LoneNode:
        try:
            subprocess.run(["ip", "netns", "add", self.ns], check=True, capture_output=True)
            subprocess.run(
                ["ip", "-n", self.ns, "link", "set", "lo", "up"], check=True, capture_output=True
            )
            ray = str(Path(sys.executable).parent / "ray")
            argv = [ray, "start", "--head", "--port", str(RAY_PORT), "--num-cpus", "2",
                    "--include-dashboard=false", "--disable-usage-stats"]  # fmt: skip
            self.run(argv, timeout=120)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env(self) -> dict[str, str]:
        return {
            **child_env(),
            "RAY_TMPDIR": str(self.ray_tmpdir),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }

    def run(self, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *argv], env=self.env(), capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip

    def start(self, argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as f:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.ns, *argv], env=self.env(), stdout=f,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def close(self) -> None:
        remove(self.ns)
        shutil.rmtree(self.ray_tmpdir, ignore_errors=True)
