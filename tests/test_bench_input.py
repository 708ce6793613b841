"""pdserve bench on what a user brings: trace files checked line by line (the line and the field
named), options checked before any server starts, a server that does not start or a request
that fails said in one line, and SIGTERM stopping the servers the bench started."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench import cli, report, session, slo, trace
from bench.errors import BenchError
from bench.loadgen import RequestResult
from bench.server import ServerProcess

GOOD = {"arrival_s": 0.5, "prompt_len": 8, "output_len": 4}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    "line, said",
    [
        ("{not json", "line 2: not JSON"),
        ("[1, 2, 3]", "line 2: a JSON object is expected, got list"),
        ('{"arrival_s": 1, "prompt_len": 8}', "line 2: output_len: missing"),
        ('{"arrival_s": 1, "prompt_len": "abc", "output_len": 4}', "line 2: prompt_len: an integer"),  # noqa: E501
        ('{"arrival_s": 1, "prompt_len": 20.7, "output_len": 4}', "line 2: prompt_len: an integer"),
        ('{"arrival_s": 1, "prompt_len": true, "output_len": 4}', "line 2: prompt_len: an integer"),
        ('{"arrival_s": 1, "prompt_len": 8, "output_len": 0}', "line 2: output_len: an integer >= 1"),  # noqa: E501
        ('{"arrival_s": "nan", "prompt_len": 8, "output_len": 4}', "line 2: arrival_s: a number"),
        ('{"arrival_s": NaN, "prompt_len": 8, "output_len": 4}', "line 2: arrival_s: must be finite"),  # noqa: E501
        ('{"arrival_s": -1, "prompt_len": 8, "output_len": 4}', "line 2: arrival_s: must be finite"),  # noqa: E501
        ('{"arrival_s": 0.1, "prompt_len": 8, "output_len": 4}', "line 2: arrival_s 0.1 is before"),
        ('{"arrival_s": 1, "prompt_len": 8, "output_len": 4, "prefix_id": "s", "prefix_len": 9}',
         "line 2: prefix_len: 9 is longer than prompt_len 8"),
        ('{"arrival_s": 1, "prompt_len": 8, "output_len": 4, "prefix_id": [3]}',
         "line 2: prefix_id: a string"),
    ],
)  # fmt: skip
def test_a_bad_trace_line_is_refused_naming_its_line_and_field(tmp_path, line, said):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(trace.TraceError, match=said.replace("(", r"\(")):
        trace.load(str(path))


def test_blank_lines_are_skipped_but_a_trace_needs_a_request(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n" + json.dumps(GOOD) + "\n\n  \n")
    assert [r.prompt_len for r in trace.load(str(path))] == [8]
    path.write_text("\n\n")
    with pytest.raises(trace.TraceError, match="no requests in it"):
        trace.load(str(path))


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"arrival_s": 1, "x": "\xff"}\n')
    with pytest.raises(trace.TraceError, match="line 2: not UTF-8"):
        trace.load(str(path))


@pytest.mark.parametrize(
    "doc, said",
    [
        ({"conversations": []}, "a list of conversations is expected"),
        ([{"conversations": ["hello"]}], "conversation 0: conversations: a list of turns"),
        ([{"conversations": [{"from": "human", "value": 5}]}], "conversation 0: conversations"),
        ([{"conversations": {"from": "human"}}], "conversation 0: conversations"),
    ],
)
def test_a_sharegpt_file_of_another_shape_is_refused_naming_the_conversation(tmp_path, doc, said):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(trace.TraceError, match=said):
        trace.load(str(path))


def test_sharegpt_skips_are_said_arrivals_follow_the_seed_and_scale_is_refused(tmp_path, capsys):
    path = tmp_path / "sg.json"
    talk = [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 8000}]
    doc = [{"conversations": talk}] * 3 + [{"conversations": talk[:1]}, {"id": "no turns"}]
    path.write_text(json.dumps(doc))
    a = trace.load(str(path), seed=1)
    assert len(a) == 3 and all(r.output_len == trace.MAX_SHAREGPT_OUTPUT for r in a)
    assert "2 conversations without a human turn and a reply skipped; 3 replies longer than " \
        "1024 tokens capped" in capsys.readouterr().out  # fmt: skip
    assert [r.arrival_s for r in trace.load(str(path), seed=1)] == [r.arrival_s for r in a]
    assert [r.arrival_s for r in trace.load(str(path), seed=2)] != [r.arrival_s for r in a]
    with pytest.raises(trace.TraceError, match="--scale: ShareGPT prompts are sent as text"):
        trace.load(str(path), scale=2.0)
    lines = tmp_path / "lines.json"  # JSON lines under a .json name
    lines.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(trace.TraceError, match=r"Extra data, line 2 \(a JSON-lines trace\?"):
        trace.load(str(lines))


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--rate", "0"),
        ("--rate", "-1"),
        ("--rate", "inf"),
        ("--burstiness", "0"),
        ("--prompt-len", "50:10"),
        ("--output-len", "0:5"),
        ("--prompt-len", "abc"),
        ("--prefixes", "4"),
        ("--prefixes", "0:512"),
        ("--prefixes", "4:x"),
        ("--num-requests", "0"),
        ("--repeat", "0"),
        ("--slo-ttft", "-1"),
        ("--slo-itl", "0"),
        ("--threads", "0"),
        ("--scale", "0"),
        ("--timeout", "0"),
        ("--timeout", "1e30"),  # gRPC takes a deadline that far off as past
        ("--capacity-clients", "0"),
        ("--max-pending", "0"),
        ("--step-target-ms", "soon"),
        ("--address", "127.0.0.1:99999"),
        ("--metrics-address", "::1"),
    ],
)
def test_an_option_out_of_range_is_refused_naming_it(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args([f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


class NoServer:
    def __init__(self, *a, **k) -> None:
        raise AssertionError("a server was started")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--trace", "{missing}"], "error: --trace: no built-in trace"),
        (["--trace", "{bad}"], "error: --trace: {bad}: line 1: output_len: missing"),
        (["--trace", "synthetic", "--scale", "2"], "error: --trace: synthetic: --scale"),
        (["--policy", ","], "error: --policy: no policy named in ','"),
        (["--prefixes", "4:512"], "error: --prefixes: an option of the synthetic trace"),
        (["--burstiness", "0.3"], "error: --burstiness: an option of the synthetic trace"),
        (["--trace", "chat", "--prompt-len", "8:16"], "error: --prompt-len: an option of the"),
        (["--overload", "3", "--burstiness", "0.3"], "error: --burstiness: the overload run's"),
        (["--json", "{tmp}/no/such/folder/out.json"], "error: --json: "),
        (["--json", "{tmp}"], "error: --json: {tmp} is a folder"),
        (["--plot", "/proc/no-such-plots"], "error: --plot: /proc/no-such-plots: "),
        (["--capacity-clients", "3"], "error: --capacity-clients: an option of the overload run"),
        (["--duration", "5", "--policy", "auto"], "error: --duration: an option of the overload"),
        (["--plot", "{tmp}/plots", "--policy", "nope"], "error: --policy: unknown ['nope']"),
    ],
)
def test_bad_input_ends_in_one_error_line_before_any_server_starts(
    monkeypatch, tmp_path, capsys, argv, said
):
    monkeypatch.setattr(cli, "ServerProcess", NoServer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 3}\n')
    names = {"missing": str(tmp_path / "nope.jsonl"), "bad": str(bad), "tmp": str(tmp_path)}
    argv = [a.format(**names) for a in argv]
    assert cli.main(_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(said.format(**names)) and err.count("\n") == 1, err
    assert not (tmp_path / "plots").exists()  # a refused command leaves no folder behind


def test_a_flag_of_auto_in_any_case_and_a_host_alone_are_taken(monkeypatch, capsys):
    args = _parser().parse_args(["--step-target-ms", "AUTO", "--address", "10.0.0.7"])
    assert args.step_target_ms == "auto" and args.address == "10.0.0.7:50051"
    # A hold of 0 is its default (prompts never wait), as serve takes it: no step target needed.
    monkeypatch.setattr(cli, "ServerProcess", NoServer)
    assert cli.main(_parser().parse_args(["--prefill-hold-ms", "0", "--policy", "nope"])) == 2
    assert capsys.readouterr().err.startswith("error: --policy: unknown ['nope']")


def test_a_server_that_exits_at_start_is_quoted_with_its_status(tmp_path):
    """`pdserve serve` refusing its options (exit 2) ends the bench with its error line."""
    log = tmp_path / "colocated.log"
    server = ServerProcess.__new__(ServerProcess)
    server._log = open(log, "w")
    server.log_path, server.policy = log, "colocated"
    server.port = server.admin_port = server.metrics_port = 0
    say = "import sys; print('loading'); print(\"error: model 'nope' not found\"); sys.exit(2)"
    server.proc = subprocess.Popen([sys.executable, "-c", say], stdout=server._log)
    server.proc.wait(30)
    with pytest.raises(BenchError) as exc:
        server.wait_ready(timeout_s=10)
    assert exc.value.status == 2
    assert str(exc.value).startswith(
        "pdserve serve (colocated) exited with status 2: error: model 'nope' not found"
    )
    assert str(log) in str(exc.value)
    server.stop()


def test_an_unreachable_address_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setattr(session.grpc, "insecure_channel", _refusing_channel)
    assert cli.main(_parser().parse_args(["--address", "127.0.0.1:1", "--slo-ttft", "1"])) == 1
    assert capsys.readouterr().err == "error: --address 127.0.0.1:1: UNAVAILABLE: refused\n"


def _refusing_channel(*a, **k):
    import grpc

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "refused"

    raise Refused()


def _failing_run(address, reqs, rate, vocab, args, label, objective=None, seed=None):
    out = []
    for i, r in enumerate(reqs):
        res = RequestResult(i, r.prompt_len, r.output_len, 0.0, status="INVALID_ARGUMENT")
        res.error = "prompt_len: too long" if i % 3 else "max_tokens: too many"
        out.append(res)
    return out, 10.0


def test_failed_requests_say_why_and_a_run_where_none_completed_fails(
    monkeypatch, tmp_path, capsys
):
    class Info:
        vocab_size = 100

    monkeypatch.setattr(session, "run_trace", _failing_run)
    monkeypatch.setattr(session, "server_info", lambda address, auth: Info())
    monkeypatch.setattr(session, "objective", lambda *a: slo.Slo(1.0, 0.1))
    out = tmp_path / "out.json"
    argv = ["--address", "x", "--policy", "colocated", "--num-requests", "6", "--json", str(out)]
    assert cli.main(_parser().parse_args(argv)) == 1
    printed = capsys.readouterr()
    assert "colocated: not completed: 4 x INVALID_ARGUMENT: prompt_len: too long; 2 x " \
        "INVALID_ARGUMENT: max_tokens: too many" in printed.out  # fmt: skip
    assert printed.err == "error: no request of colocated completed (why: above)\n"
    records = json.loads(out.read_text())["requests"]
    assert {r["error"] for r in records} == {"prompt_len: too long", "max_tokens: too many"}


def test_failures_are_summed_commonest_first():
    ok = RequestResult(0, 4, 1, 0.0, 0.1, [0.1], 0.1, 1)
    cut = RequestResult(1, 4, 5, 0.0, 0.1, [0.1], 0.1, 1)  # OK, but fewer tokens than asked
    gone = [RequestResult(i, 4, 5, 0.0, status=f"S{i}") for i in range(5)]
    assert report.failures([ok]) == ""
    assert report.failures([ok, cut, *gone]) == "1 x cut short; 1 x S0; 1 x S1; 3 more"


def test_sigterm_stops_the_server_the_bench_started(monkeypatch, capsys):
    """A `timeout` or a CI job's SIGTERM unwinds as Ctrl-C does: the server is stopped."""
    stopped = []

    class Server:
        def __init__(self, deployment, policy, log) -> None:
            self.policy = policy

        def wait_ready(self):
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not stop the run")

        def stop(self) -> None:
            stopped.append(self.policy)

    monkeypatch.setattr(cli, "ServerProcess", Server)
    before = signal.getsignal(signal.SIGTERM)
    argv = ["--policy", "colocated,disaggregated", "--num-requests", "2"]
    assert cli.main(_parser().parse_args(argv)) == 143
    assert stopped == ["colocated"]  # the one started, and no other after it
    assert "stopped: the servers this bench started are stopped" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_interrupt_while_a_server_stops_kills_it_rather_than_leave_it(tmp_path):
    """Ctrl-C (or SIGTERM) again during a server's drain: its session is killed at once."""
    log = tmp_path / "colocated.log"
    server = ServerProcess.__new__(ServerProcess)
    server._log = open(log, "w")
    server.log_path, server.policy = log, "colocated"
    deaf = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    server.proc = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True)
    time.sleep(0.5)  # its handler is set
    wait = server.proc.wait
    calls = []

    def interrupted(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:  # the drain's wait
            raise KeyboardInterrupt
        return wait(timeout)

    server.proc.wait = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        server.stop()
    assert server.proc.poll() == -signal.SIGKILL
