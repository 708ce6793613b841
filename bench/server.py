"""One `pdserve serve` process per policy: started with the same total resources each time,
waited for (bounded), and stopped with SIGINT so that it drains."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from bench.errors import BenchError
from pdserve_proto import admin_pb2, admin_pb2_grpc
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc

# The study's policies: how each maps onto `pdserve serve` (its --policy, extra flags, and how
# the deployment's workers are laid out: "split" into prefill and decode pools, every worker a
# decode worker ("decode"), or every worker one that does both ("both")).
POLICIES = {
    "colocated-nochunk": ("colocated", ["--no-chunked-prefill"], "decode"),
    "colocated": ("colocated", [], "decode"),
    "disaggregated": ("disaggregated", [], "split"),
    "threshold": ("threshold", [], "split"),
    "auto": ("auto", [], "split"),
    "flex": ("auto", [], "both"),
}


@dataclass(frozen=True, slots=True)
class Deployment:
    model: str
    num_prefill: int
    num_decode: int
    threads: int
    kv_cache_gib: float
    threshold_tokens: int
    threshold_queue: int
    # `pdserve serve --step-target-ms` (a number, or "auto"), for the chunked policies
    step_target_ms: float | str | None = None
    max_pending: int | None = None  # `pdserve serve --max-pending` (None: the server's default)
    # `pdserve serve --prefill-hold-ms` (a number, or "auto"), with a step target
    prefill_hold_ms: float | str | None = None
    # `pdserve serve --gpus-per-worker` (None: the server's default, 1 where CUDA is present);
    # a fraction lets every policy's workers share the GPUs there are
    gpus_per_worker: float | None = None

    def args(self, policy: str) -> list[str]:
        """Every policy gets the same total workers: split into the two pools, all decode
        workers (colocated policies), or all workers that do both (flex)."""
        name, extra, layout = POLICIES[policy]
        total = self.num_prefill + self.num_decode
        prefill, decode, both = {
            "split": (self.num_prefill, self.num_decode, 0),
            "decode": (0, total, 0),
            "both": (0, 0, total),
        }[layout]
        if self.step_target_ms is not None and "--no-chunked-prefill" not in extra:
            extra = [*extra, "--step-target-ms", str(self.step_target_ms)]
            if self.prefill_hold_ms is not None:
                extra = [*extra, "--prefill-hold-ms", str(self.prefill_hold_ms)]
        if self.max_pending is not None:
            extra = [*extra, "--max-pending", str(self.max_pending)]
        if self.gpus_per_worker is not None:
            extra = [*extra, "--gpus-per-worker", str(self.gpus_per_worker)]
        return [
            "--model", self.model,
            "--prefill", str(prefill),
            "--decode", str(decode),
            "--workers", str(both),
            "--policy", name,
            "--threads", str(self.threads),
            "--kv-cache-gib", str(self.kv_cache_gib),
            "--threshold-tokens", str(self.threshold_tokens),
            "--threshold-queue", str(self.threshold_queue),
            "--metrics-port", "0",
            *extra,
        ]  # fmt: skip


_LISTENING = re.compile(r"pdserve listening on [^\s:]+:(\d+)")
_ADMIN = re.compile(r"admin service \(operators only\) on [^\s:]+:(\d+)")
_METRICS = re.compile(r"metrics on http://[^\s:]+:(\d+)/metrics")


class ServerProcess:
    """`pdserve serve` in a child process, on ports it picks itself (port 0) and names in its log:
    a port picked here and bound there later could be taken in between by another process."""

    def __init__(self, deployment: Deployment, policy: str, log: Path) -> None:
        self._log = open(log, "w")
        # Its own admin port too (worker pids for the overload run): not the default 50052,
        # which another server on this machine may hold; its metrics port, as its log names it
        # (how busy each worker was during a run).
        cmd = [sys.executable, "-m", "router.cli", "serve", "--port", "0", "--admin-port", "0"]
        self.proc = subprocess.Popen(
            cmd + deployment.args(policy),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.log_path = log
        self.policy = policy
        self.port = 0
        self.admin_port = 0
        self.metrics_port = 0

    @property
    def address(self) -> str:
        if not self.port:
            raise RuntimeError("the server's port is known once wait_ready() returns")
        return f"127.0.0.1:{self.port}"

    @property
    def admin_address(self) -> str:
        if not self.admin_port:
            raise RuntimeError("the server's admin port is known once wait_ready() returns")
        return f"127.0.0.1:{self.admin_port}"

    def _ports_from_log(self) -> bool:
        text = self.log_path.read_text(errors="replace")
        main, admin = _LISTENING.search(text), _ADMIN.search(text)
        if main is None or admin is None:
            return False
        self.port, self.admin_port = int(main.group(1)), int(admin.group(1))
        metrics = _METRICS.search(text)  # logged before it listens
        self.metrics_port = int(metrics.group(1)) if metrics else 0
        return True

    @property
    def metrics_address(self) -> str | None:
        return f"127.0.0.1:{self.metrics_port}" if self.metrics_port else None

    async def pids(self) -> dict[str, int]:
        """The router's process id (`router`) and each ready worker's on this host, by worker
        id, as its admin service lists them now (a replaced worker has a new one). A worker on
        another node is left out: its pid means another process here."""
        out = {"router": self.proc.pid}
        async with grpc.aio.insecure_channel(self.admin_address) as channel:
            listing = await admin_pb2_grpc.AdminStub(channel).ListWorkers(
                admin_pb2.ListWorkersRequest(), timeout=5
            )
        here = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
        for w in listing.workers:
            if w.pid and w.status == "ready" and (not w.node_ip or w.node_ip in here):
                out[w.worker_id] = w.pid
        return out

    def wait_ready(self, timeout_s: float = 600.0) -> pb.InfoResponse:
        """The server's Info once it answers; BenchError where it exits first (its own error
        line quoted; exit status 2 where its was: bad input) or does not answer in time."""
        deadline = time.monotonic() + timeout_s
        while not self._ports_from_log():
            self._check_running()
            if time.monotonic() > deadline:
                raise BenchError(f"pdserve serve not listening in {timeout_s:.0f} s; its log: "
                                 f"{self.log_path}")  # fmt: skip
            time.sleep(0.05)
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while True:
                self._check_running()
                try:
                    return stub.Info(pb.InfoRequest(), timeout=5, wait_for_ready=True)
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise BenchError(f"pdserve serve not ready in {timeout_s:.0f} s; its "
                                         f"log: {self.log_path}") from None  # fmt: skip

    def _check_running(self) -> None:
        code = self.proc.poll()
        if code is None:
            return
        lines = self.log_path.read_text(errors="replace").splitlines()
        said = next((ln for ln in reversed(lines) if ln.startswith("error:")), None)
        said = said or next((ln for ln in reversed(lines) if ln.strip()), "(its log is empty)")
        raise BenchError(
            f"pdserve serve ({self.policy}) exited with status {code}: {said.strip()} (its log: "
            f"{self.log_path})",
            status=2 if code == 2 else 1,
        )

    def stop(self, timeout_s: float = 120.0) -> None:
        """SIGINT (its drain), then after `timeout_s` SIGKILL to its whole session (its Ray
        too); at once when interrupted again meanwhile (Ctrl-C, SIGTERM), so that nothing is
        left running."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self._kill()
        except KeyboardInterrupt:
            self._kill()
            raise
        finally:
            self._log.close()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
