"""`pdserve serve` as a user runs it: a subprocess that serves a tiny model, answers
`pdserve complete`, and on SIGTERM drains the request in flight before it exits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pdserve_client.connect import ClientAuth
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from tests.helpers import save_gpt2_with_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(log_path, port: int, *flags: str) -> subprocess.Popen:
    """`pdserve serve` on tiny-llama at 127.0.0.1:port (a private Ray runtime), its output into
    `log_path`, in a session of its own."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--model", "tiny-llama", "--port",
             str(port), "--metrics-port", "-1", "--kv-cache-gib", "0.05", *flags],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def assert_group_ends(pgid: int, within_s: float) -> None:
    """Every process of a stopped server's group ends within `within_s`: its private Ray
    runtime's, the raylet's agents and the workers among them."""
    deadline = time.monotonic() + within_s
    with pytest.raises(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.2)
        left = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(pgid)], capture_output=True,
                              text=True).stdout  # fmt: skip
        raise AssertionError(f"left running after {within_s} s:\n{left}")


@pytest.mark.timeout(240)
def test_serve_answers_complete_and_drains_on_sigterm(tmp_path):
    """A request in flight at SIGTERM finishes; a health Watch stream (a load balancer's, which
    never ends by itself) hears NOT_SERVING and does not hold the exit to --drain-timeout
    (120 s here)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    server = start_serve(tmp_path / "serve.log", port, "--drain-timeout", "120")
    address = f"127.0.0.1:{port}"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "router.cli", "complete", "--address", address, "--wait",
             "--timeout", "180", "--max-tokens", "5", "--json", "--prompt-logprobs", "1",
             "hello"],
            capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert '"completion_tokens": 5' in done.stdout
        answer = json.loads(done.stdout)
        prompt_tokens = answer["final"]["usage"]["prompt_tokens"]
        assert len(answer["prompt_logprobs"]) == prompt_tokens - 1
        assert all(len(lp["top"]) == 1 for lp in answer["prompt_logprobs"])
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

        heard: list[int] = []

        def watch() -> None:
            with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for msg in stub.Watch(health_pb2.HealthCheckRequest(), timeout=170):
                    heard.append(msg.status)

        t, w = threading.Thread(target=stream), threading.Thread(target=watch)
        t.start()
        w.start()
        assert started.wait(60)
        deadline = time.monotonic() + 30
        while not heard:  # the Watch has said SERVING: it is open
            assert time.monotonic() < deadline, "no health Watch answer"
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        t.join(120)
        assert len(got) == 300 and final and final[0].finish_reason == pb.FINISH_REASON_LENGTH
        t0 = time.monotonic()
        assert server.wait(60) == 0
        assert time.monotonic() - t0 < 30  # the Watch stream held it to the drain timeout
        assert_group_ends(server.pid, within_s=10)
        w.join(10)
        assert heard[0] == health_pb2.HealthCheckResponse.SERVING, heard
        assert heard[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, heard
        # Once stopped, nothing answers.
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError):
                pb_grpc.GenerationStub(channel).Complete(req, timeout=2)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["no-such-model", "gpt2-folder"])
def test_a_model_that_is_not_there_stops_serve_in_one_line_before_ray(tmp_path, model):
    """Checked before Ray or any worker starts: exit 2, one line naming the model. A folder of an
    architecture pdserve does not run, with a tokenizer, is refused there too (not by every
    worker, after Ray started)."""
    said = "model 'no-such-model' not found"
    if model == "gpt2-folder":
        save_gpt2_with_tokenizer(tmp_path)
        model, said = str(tmp_path), "has architecture GPT2LMHeadModel, which pdserve does not run"
    argv = [sys.executable, "-m", "router.cli", "serve", "--model", model,
            "--ray-address", "local", "--port", "0", "--metrics-port", "-1"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and said in errors[0], out.stderr
    assert "Ray" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.timeout(150)
def test_a_kv_cache_too_large_stops_serve_in_a_few_lines_naming_the_option():
    """Each worker's constructor fails: the error says what it raised in one line (Ray quotes
    its whole traceback, coloured), and the engine's error names the option."""
    argv = [sys.executable, "-m", "router.cli", "serve", "--model", "tiny-llama",
            "--kv-cache-gib", "100000", "--ray-address", "local", "--port", "0",
            "--metrics-port", "-1", "--admin-port", "-1"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=140)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    (error,) = [ln for ln in lines if ln.startswith("error: ")]
    assert error.startswith("error: workers did not start: "), error
    assert "its start raised engine.errors.KVCacheAllocationError: the KV cache does not fit on " \
           "cpu" in error and "(serve sets it with --kv-cache-gib)" in error, error  # fmt: skip
    assert "Traceback" not in out.stderr and "\x1b[" not in out.stderr, out.stderr[-3000:]
    assert len(lines) < 12, out.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", ["--port", "--http-port", "--admin-port"])
def test_a_port_taken_stops_serve_in_one_line_before_ray(option):
    """A port another server holds (the one being replaced, still draining) is found before
    Ray and any worker start: exit 2, one line naming the option (it came after every worker
    had loaded its model)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = {"--port": "0", "--http-port": "0", "--admin-port": "0", option: str(port)}
        argv = [sys.executable, "-m", "router.cli", "serve", "--model", "tiny-llama",
                "--ray-address", "local", "--metrics-port", "-1",
                *(x for kv in ports.items() for x in kv)]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == [f"error: {option}: 127.0.0.1:{port} is taken (Address already in use): "
                      "another server there, or one still draining?"], out.stderr  # fmt: skip
    assert "Ray" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


class StuckStreams:
    """A gRPC and an HTTP stream of 900 tokens on a server started with an admin and an HTTP
    port, whose workers are then stopped (SIGSTOP): neither can end by itself. How each ended:
    `ended["grpc"]` its status and details, `ended["http"]` the last event's error code (or
    the transport error)."""

    def __init__(self, tmp_path, drain_timeout: str) -> None:
        from pdserve_proto import admin_pb2, admin_pb2_grpc

        port, admin, self.http_port = free_port(), free_port(), free_port()
        self.log_path = tmp_path / "serve.log"
        self.server = start_serve(self.log_path, port, "--admin-port", str(admin),
                                  "--http-port", str(self.http_port),
                                  "--drain-timeout", drain_timeout)  # fmt: skip
        self.address = f"127.0.0.1:{port}"
        self.got = {"grpc": 0, "http": 0}
        self.ended: dict[str, str] = {}
        self.started = {k: threading.Event() for k in self.got}
        self.stopped: list[int] = []
        self.threads = [threading.Thread(target=f) for f in (self._grpc, self._http)]
        with ClientAuth().channel(f"127.0.0.1:{admin}") as channel:  # tries about once a second
            listing = admin_pb2_grpc.AdminStub(channel).ListWorkers(
                admin_pb2.ListWorkersRequest(), timeout=150, wait_for_ready=True
            )
        self.pids = [w.pid for w in listing.workers]
        assert len(self.pids) == 2, listing

    def _grpc(self) -> None:
        req = pb.GenerateRequest(
            prompt="stopped mid-stream",
            sampling=pb.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True),
        )
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = pb_grpc.GenerationStub(channel)
                for msg in stub.Generate(req, timeout=180, wait_for_ready=True):
                    self.got["grpc"] += len(msg.token_ids)
                    self.started["grpc"].set()
            self.ended["grpc"] = "finished"
        except grpc.RpcError as exc:
            self.ended["grpc"] = f"{exc.code().name}: {exc.details()}"

    def _http(self) -> None:
        import httpx2 as httpx

        body = {"model": "tiny-llama", "prompt": "stopped too", "max_tokens": 900,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        url = f"http://127.0.0.1:{self.http_port}/v1/completions"
        last = ""
        try:
            with httpx.Client(timeout=180) as client, client.stream("POST", url, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        last = line
                        self.got["http"] += 1
                        self.started["http"].set()
            error = json.loads(last[len("data: ") :]).get("error") if last else None
            self.ended["http"] = f"error {error['code']}: {error['message']}" if error else "done"
        except httpx.HTTPError as exc:
            self.ended["http"] = type(exc).__name__

    def stream_then_stop_the_workers(self) -> None:
        for t in self.threads:
            t.start()
        ok = all(e.wait(60) for e in self.started.values())
        assert ok, self.log_path.read_text()[-3000:]
        for pid in self.pids:  # the workers stop: neither stream can end
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)

    def close(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(10)

    def assert_ended_with(self, why: str) -> None:
        """Both streams were ended with `why`, each door's way."""
        assert self.ended == {"grpc": f"UNAVAILABLE: {why}", "http": f"error shutting_down: {why}"}

    def assert_clean_log(self) -> None:
        text = self.log_path.read_text()
        for bad in ("Traceback", "Exception in ASGI application", "CancelledError"):
            assert bad not in text, text[-4000:]


@pytest.mark.timeout(240)
def test_requests_left_at_the_drain_timeout_end_with_a_clear_error_on_both_doors(tmp_path):
    """SIGTERM drains for --drain-timeout (3 s); a gRPC and an HTTP stream that cannot end by
    then get an answer that says so (UNAVAILABLE; an error event), not a cut call, and the
    server exits 0 without a traceback."""
    run = StuckStreams(tmp_path, "3")
    try:
        run.stream_then_stop_the_workers()
        run.server.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for t in run.threads:
            t.join(60)
        took = time.monotonic() - t0
        assert 3 <= took < 3 + 5, took  # at the drain timeout, not at the doors' own grace
        run.assert_ended_with("the server is shutting down: its drain timeout (3 s) passed")
        assert run.server.wait(90) == 0, run.log_path.read_text()[-3000:]
        assert "drain timeout (3 s) passed: ended the 2 requests still in flight" in (
            run.log_path.read_text()
        )
        # Its stopped workers, which answer no load call, were not waited for (10 s).
        assert "decode-0, prefill-0 gave no load within 2 s of the stop: stopped without" in (
            run.log_path.read_text()
        )
        run.assert_clean_log()
    finally:
        run.close()


@pytest.mark.timeout(240)
def test_a_second_interrupt_while_draining_ends_the_requests_in_flight_at_once(tmp_path):
    """SIGINT drains (up to --drain-timeout, 120 s here) a gRPC and an HTTP stream that cannot
    end (their workers stopped); a second SIGINT ends both now, each with an answer that says
    so, and the server exits 0 in seconds. The same signal twice within a second (a wrapper,
    such as `timeout`, passing on the Ctrl-C its process group got too) is one: it drains."""
    run = StuckStreams(tmp_path, "120")
    try:
        run.stream_then_stop_the_workers()
        run.server.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30  # taken (not merged with the next by the kernel)
        while "shutting down: draining" not in run.log_path.read_text():
            assert time.monotonic() < deadline, run.log_path.read_text()[-3000:]
            time.sleep(0.01)
        run.server.send_signal(signal.SIGINT)
        time.sleep(2)
        assert run.server.poll() is None and not run.ended, (run.ended, run.got)  # draining
        run.server.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert run.server.wait(90) == 0, run.log_path.read_text()[-3000:]
        assert time.monotonic() - t0 < 45, time.monotonic() - t0  # not the 120 s drain
        for t in run.threads:
            t.join(30)
        run.assert_ended_with("the server is shutting down: interrupted again")
        assert run.got["grpc"] < 900 and run.got["http"] < 900, run.got
        assert "interrupted again" in run.log_path.read_text()
        assert "a second signal within 1 s of the first: draining still" in (
            run.log_path.read_text()
        )
        # Its stopped workers' engines, which cannot answer, were not waited for (10 s).
        assert "the workers stop without their engines' own stop" in run.log_path.read_text()
        run.assert_clean_log()
    finally:
        run.close()


@pytest.mark.timeout(200)
def test_sigint_during_the_start_stops_it_at_once(tmp_path):
    """A start waits for its workers (here a decode worker asks for a resource no node has,
    up to --start-timeout, 600 s): SIGINT stops it at once, the workers started so far with it,
    and nothing of the server or its Ray runtime is left running."""
    log_path = tmp_path / "serve.log"
    server = start_serve(
        log_path, free_port(), "--ray-address", "local", "--start-timeout", "600",
        "--decode-resources", '{"no_node_has_this": 1}',
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "no node has room" not in log_path.read_text():  # decode-0 waits for room
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        server.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert server.wait(60) == 0, log_path.read_text()[-3000:]
        assert time.monotonic() - t0 < 30, "the start ran on after SIGINT"
        out = log_path.read_text()
        assert "interrupted during the start" in out and out.rstrip().endswith("stopped"), out
        assert "Traceback" not in out, out
        assert_group_ends(server.pid, within_s=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)


@pytest.mark.timeout(240)
def test_sigterm_to_the_process_group_drains(tmp_path):
    """SIGTERM to the server's whole process group (systemd's, `timeout`'s, a supervisor's
    `kill -- -PGID`) drains like SIGTERM to the server alone: the private Ray runtime's own
    processes, started in that group, do not take it (some ended, and the streams in flight
    failed once their workers became unreachable)."""
    run = StuckStreams(tmp_path, "120")
    try:
        run.stream_then_stop_the_workers()  # neither stream can end before the check below
        ps = ["ps", "-o", "pid=", "-g", str(run.server.pid)]
        group = {int(p) for p in subprocess.run(ps, capture_output=True, text=True).stdout.split()}
        ray_processes = group - {run.server.pid}
        assert ray_processes, group  # the private runtime's processes share the server's group
        os.killpg(run.server.pid, signal.SIGTERM)
        time.sleep(5)
        gone = [p for p in ray_processes if not os.path.exists(f"/proc/{p}")]
        assert not gone, (gone, run.log_path.read_text()[-3000:])
        for pid in run.stopped:  # the workers go on: both streams end, drained
            os.kill(pid, signal.SIGCONT)
        run.stopped.clear()
        for t in run.threads:
            t.join(120)
        assert run.ended == {"grpc": "finished", "http": "done"}, run.ended
        assert run.got["grpc"] == 900, run.got
        assert run.server.wait(60) == 0, run.log_path.read_text()[-3000:]
        run.assert_clean_log()
    finally:
        run.close()
