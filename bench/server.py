"""One `pdserve serve` process per policy: started with the same total resources each time,
waited for (bounded), and stopped with SIGINT so that it drains."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

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
        if self.max_pending is not None:
            extra = [*extra, "--max-pending", str(self.max_pending)]
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
            "--metrics-port", "-1",
            *extra,
        ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, deployment: Deployment, policy: str, log: Path) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Its own admin port too (worker pids for the overload run): not the default 50052,
        # which another server on this machine may hold.
        admin_port = _free_port()
        self.admin_address = f"127.0.0.1:{admin_port}"
        self._log = open(log, "w")
        cmd = [sys.executable, "-m", "router.cli", "serve", "--port", str(self.port),
               "--admin-port", str(admin_port)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd + deployment.args(policy),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.log_path = log

    def wait_ready(self, timeout_s: float = 600.0) -> pb.InfoResponse:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"pdserve serve exited; see {self.log_path}")
                try:
                    return stub.Info(pb.InfoRequest(), timeout=5, wait_for_ready=True)
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"server not ready in {timeout_s:.0f} s") from None

    def stop(self, timeout_s: float = 120.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()
