"""`pdserve serve` as a user runs it: a subprocess that serves a tiny model, answers
`pdserve complete`, and on SIGTERM drains the request in flight before it exits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import grpc
import pytest

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_serve_answers_complete_and_drains_on_sigterm(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--model", "tiny-llama", "--port",
         str(port), "--metrics-port", "-1", "--kv-cache-gib", "0.05"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "router.cli", "complete", "--address", address, "--wait",
             "--timeout", "180", "--max-tokens", "5", "--json", "hello"],
            capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert '"completion_tokens": 5' in done.stdout
        # A long request in flight, then SIGTERM: it must finish, not be cut.
        req = pb.GenerateRequest(
            prompt="drain me",
            sampling=pb.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True),
        )
        got: list[int] = []
        final: list[pb.FinalInfo] = []
        started = threading.Event()

        def stream() -> None:
            with grpc.insecure_channel(address) as channel:
                for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=120):
                    got.extend(msg.token_ids)
                    started.set()
                    if msg.HasField("final"):
                        final.append(msg.final)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        server.send_signal(signal.SIGTERM)
        t.join(120)
        assert len(got) == 300 and final and final[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert server.wait(60) == 0
        # Once stopped, nothing answers.
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError):
                pb_grpc.GenerationStub(channel).Complete(req, timeout=2)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()


@pytest.mark.timeout(120)
def test_a_model_that_is_not_there_stops_serve_in_one_line_before_ray():
    """Checked before Ray or any worker starts: exit 2, one line naming the model."""
    argv = [sys.executable, "-m", "router.cli", "serve", "--model", "no-such-model",
            "--ray-address", "local", "--port", "0", "--metrics-port", "-1"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "model 'no-such-model' not found" in errors[0], out.stderr
    assert "Ray" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
