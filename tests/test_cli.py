"""`pdserve generate` in-process: output on success, one-line errors with exit status 2."""

import argparse
import contextlib
import re
import socket
import threading
import time

import pytest

from engine.tiny_models import build_tiny_model
from router import serve_options
from router.cli import main


def run(argv: list[str]) -> int:
    # argparse's own usage errors leave through SystemExit; handler errors return a status.
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_generate_prints_a_completion(capsys):
    argv = ["generate", "--model", "tiny-llama", "--temperature", "0", "--max-tokens", "5"]
    assert run([*argv, "hello"]) == 0
    out = capsys.readouterr().out
    assert out.strip()
    assert "===" not in out  # one prompt: just its text


def test_generate_labels_each_of_several_prompts(capsys):
    argv = ["generate", "--model", "tiny-llama", "--temperature", "0", "--max-tokens", "3"]
    assert run([*argv, "first prompt", "second prompt"]) == 0
    out = capsys.readouterr().out
    assert out.index("first prompt") < out.index("second prompt")


def test_bad_top_p_exits_2_naming_the_field(capsys):
    assert run(["generate", "--model", "tiny-llama", "--top-p", "2", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "top_p" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_generate_penalties_reach_the_engine_and_bad_ones_are_named(capsys):
    argv = ["generate", "--model", "tiny-llama", "--max-tokens", "24", "hello"]
    assert run(argv) == 0
    plain = capsys.readouterr().out
    assert run([*argv, "--repetition-penalty", "2", "--frequency-penalty", "2"]) == 0
    assert capsys.readouterr().out != plain
    assert run([*argv, "--presence-penalty", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: presence_penalty: ") and "Traceback" not in err
    assert run([*argv, "--logit-bias", "5=101"]) == 2
    assert capsys.readouterr().err.startswith("error: logit_bias: ")
    assert run([*argv, "--logit-bias", "five=1"]) == 2
    assert "TOKEN=BIAS" in capsys.readouterr().err
    # A bias of 100 on one token: every token is that one.
    assert run(["generate", "--model", "tiny-llama", "--max-tokens", "4", "--logit-bias", "42=100",
                "hello"]) == 0  # fmt: skip
    from engine.config import ModelConfig
    from engine.loader import load_model

    forced = load_model(ModelConfig(model="tiny-llama")).tokenizer.decode([42] * 4)
    assert capsys.readouterr().out.strip() == forced.strip()


def test_complete_sends_penalties_and_biases():
    import argparse

    from router.client import add_arguments, build_request

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--repetition-penalty", "1.3", "--logit-bias", "5=-100", "--logit-bias",
                         "7=2.5", "hi"])  # fmt: skip
    sampling = build_request(args).sampling
    assert dict(sampling.logit_bias) == {5: -100.0, 7: 2.5}
    assert sampling.repetition_penalty == pytest.approx(1.3)
    assert not sampling.HasField("presence_penalty")  # unset: the server's default


def test_complete_sends_every_sampling_flag_and_leaves_the_unset_to_the_server():
    import argparse

    from router.client import add_arguments, build_request

    p = argparse.ArgumentParser()
    add_arguments(p)
    sampling = build_request(p.parse_args(["hi"])).sampling
    for name in ("top_p", "top_k", "min_p", "seed", "logprobs", "prompt_logprobs", "max_tokens"):
        assert not sampling.HasField(name), name
    assert sampling.temperature == 0 and not sampling.ignore_eos
    args = p.parse_args(["--top-p", "0.5", "--top-k", "7", "--min-p", "0.25", "--logprobs", "3",
                         "--stop-token-id", "9", "--stop-token-id", "11", "--ignore-eos",
                         "--temperature", "0.8", "--seed", "5", "--prompt-logprobs", "0",
                         "hi"])  # fmt: skip
    sampling = build_request(args).sampling
    assert sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs == 0
    assert (sampling.top_p, sampling.top_k, sampling.min_p) == (0.5, 7, 0.25)
    assert (sampling.logprobs, sampling.seed, list(sampling.stop_token_ids)) == (3, 5, [9, 11])
    assert sampling.ignore_eos and sampling.temperature == pytest.approx(0.8)
    for bad in (["--logprobs", "21"], ["--top-k", str(2**31)], ["--stop-token-id", "-1"]):
        with pytest.raises(SystemExit):  # argparse's usage error, not a traceback
            p.parse_args([*bad, "hi"])


def test_generate_json_gives_tokens_usage_and_logprobs_per_prompt(capsys):
    import json

    from engine.config import ModelConfig
    from engine.loader import load_model
    from tests.helpers import hf_greedy

    argv = ["generate", "--model", "tiny-llama", "--no-chat", "--max-tokens", "6", "--json",
            "--logprobs", "2", "--min-p", "0.5", "--top-k", "3",
            "--prompt-logprobs", "1"]  # fmt: skip
    assert run([*argv, "hello there", "a second prompt"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    docs = [json.loads(line) for line in lines]
    assert [d["prompt"] for d in docs] == ["hello there", "a second prompt"]
    tok = load_model(ModelConfig(model="tiny-llama")).tokenizer
    for d in docs:
        ids = tok.encode(d["prompt"])
        assert d["token_ids"] == hf_greedy("tiny-llama", ids, 6)  # greedy: min-p, top-k moot
        assert d["finish_reason"] == "length" and d["stop_reason"] is None
        assert d["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6,
                              "cached_prompt_tokens": 0}  # fmt: skip
        assert [lp["token_id"] for lp in d["logprobs"]] == d["token_ids"]
        assert [lp["token_id"] for lp in d["prompt_logprobs"]] == ids[1:]
        assert all(len(lp["top"]) == 1 for lp in d["prompt_logprobs"])
        for lp in d["logprobs"]:
            assert len(lp["top"]) == 2 and lp["top"][0]["token_id"] == lp["token_id"]
            assert lp["logprob"] == pytest.approx(lp["top"][0]["logprob"]) and lp["logprob"] < 0
    assert run(["generate", "--model", "tiny-llama", "--min-p", "2", "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: min_p: ")


def test_unknown_model_exits_2_naming_it(capsys):
    assert run(["generate", "--model", "no-such-model", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-model" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("template", "said"),
    [(None, "error: chat: this model has no chat template; send a plain prompt"),
     ("{{ raise_exception('system turns only') }}",
      "error: chat: the chat template refused them: system turns only")],
)  # fmt: skip
def test_chat_without_a_usable_template_exits_2_naming_chat(capsys, tmp_path, template, said):
    model, tokenizer = build_tiny_model("tiny-llama")
    tokenizer.chat_template = template
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    assert run(["generate", "--model", str(tmp_path), "--chat", "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["complete", "--address", "127.0.0.1:99999", "hi"], "--address: the port must be a number"),
     (["complete", "--timeout", "1e30", "hi"], "--timeout: must be a number of seconds > 0 and <="),
     (["scale", "--prefill", "99999999999"], "--prefill: must be an integer in [0, 2147483648)"),
     (["scale", "--decode", "1", "--drain-timeout", "inf"], "--drain-timeout: must be a number"),
     (["workers", "--address", "::1"], "--address: an IPv6 address goes in brackets"),
     (["status", "--address", "[::1]x"], "--address: must be HOST:PORT or HOST"),
     (["complete", "hi", "extra"], "pdserve complete: error: unrecognized arguments: extra"),
     (["generate", "--dtype", "fp8", "hi"], "--dtype: must be one of auto, float32, bfloat16")],
)  # fmt: skip
def test_a_client_option_out_of_range_exits_2_naming_it(capsys, argv, said):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_generate_takes_a_dtype_as_serve_does():
    from router.cli import build_parser

    for given, dtype in (("BF16", "bfloat16"), ("half", "float16"), ("float", "float32")):
        assert build_parser().parse_args(["generate", "--dtype", given, "hi"]).dtype == dtype


def test_an_address_without_a_port_takes_the_commands_own():
    from pdserve_client.argtypes import address

    assert address(50051)("10.0.0.7") == "10.0.0.7:50051"
    assert address(50052)("[::1]") == "[::1]:50052"
    assert address(9400)("host:81") == "host:81"
    for target in ("unix:/run/pdserve.sock", "ipv4:10.0.0.1:50051", "ipv6:[::1]:50051",
                   "dns:///pdserve.example:50051", "unix-abstract:pdserve"):  # fmt: skip
        assert address(50051)(target) == target


def test_max_tokens_past_the_context_is_refused_and_the_default_is_cut_to_it(capsys):
    """As the server: an asked-for max_tokens past the context is refused, naming it; the
    default (256) is cut to what the context leaves (tiny-llama's is 1024 tokens)."""
    argv = ["generate", "--model", "tiny-llama", "--no-chat"]
    assert run([*argv, "--max-tokens", "1020", "hello"]) == 2
    err = capsys.readouterr().err
    assert "max_tokens: must be in [1, 1019] for a 5-token prompt (context 1024)" in err, err
    assert run([*argv, "--max-tokens", "0", "hello"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert run([*argv, "x" * 1000]) == 0  # 24 tokens of room: the default fits itself to them
    capsys.readouterr()
    assert run([*argv, "hello", "word " * 1100]) == 2  # which prompt, and nothing else
    err = capsys.readouterr().err
    assert err.startswith("error: prompt: has 5500 tokens") and err.count("\n") == 1, err
    assert err.endswith("(prompt 2 of 2)\n")


def test_empty_prompt_exits_2(capsys):
    assert run(["generate", "--model", "tiny-llama", ""]) == 2
    assert "prompt" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate"], ["generate", "--bogus", "x"], []])
def test_usage_errors_exit_2(argv):
    assert run(argv) == 2


@pytest.mark.parametrize(
    "argv, field",
    [
        (["serve", "--step-target-ms", "100", "--no-chunked-prefill"], "--step-target-ms"),
        (["serve", "--step-target-ms", "0"], "--step-target-ms"),
        (["bench", "--step-target-ms", "-5"], "--step-target-ms"),
    ],
)
def test_step_target_errors_name_the_flag(argv, field, capsys):
    assert run(argv) == 2  # refused before anything starts
    assert field in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value",
    [("--seed", "-1"), ("--seed", str(2**64)), ("--max-tokens", "99999999999"),
     ("--max-tokens", "0"), ("--timeout", "-1"), ("--timeout", "nan")],
)  # fmt: skip
def test_complete_refuses_values_its_request_cannot_hold_naming_the_flag(flag, value, capsys):
    assert run(["complete", "--address", "127.0.0.1:1", flag, value, "hi"]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [["scale", "--decode", "1", "--timeout", "0"], ["workers", "--timeout", "-1"],
     ["scale", "--decode", "1", "--timeout", "inf"]],
)  # fmt: skip
def test_admin_commands_refuse_a_deadline_that_is_not_one(argv, capsys):
    assert run([argv[0], "--address", "127.0.0.1:1", *argv[1:]]) == 2  # before any call
    assert "argument --timeout: must be a number of seconds > 0" in capsys.readouterr().err


def test_complete_says_no_server_only_where_none_answered(capsys):
    """A closed port: no server there. A server's own UNAVAILABLE (a worker failed) is shown as
    the server gave it."""
    from router.client import _unreached

    assert run(["complete", "--address", "127.0.0.1:1", "--timeout", "10", "hi"]) == 1
    assert "no pdserve server answering at 127.0.0.1:1?" in capsys.readouterr().err
    assert not _unreached("a worker failed: decode-0: its engine stopped")
    # A server's answer quoting a worker's connection error is still the server's.
    assert not _unreached("request failed: a worker failed: gloo: Connection refused")


def test_complete_wait_tries_the_server_again_about_once_a_second(capsys):
    """`complete --wait` before its server is up tries to connect again about once a second
    (here to a port whose listener closes each connection at once), so it starts about a
    second at most after the server: gRPC's own waits between tries grow to minutes (1 s,
    1.6 s, 2.6 s, ...: a server up after 30 s was answered 15 s later)."""
    tried: list[float] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def refuse() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                listener.accept()[0].close()
                tried.append(time.monotonic())

    t = threading.Thread(target=refuse)
    t.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        assert run(["complete", "--address", address, "--wait", "--timeout", "4", "hi"]) == 1
    finally:
        stop.set()
        t.join(5)
        listener.close()
    assert "within --timeout 4 s (waiting for a server to come up there" in capsys.readouterr().err
    assert len(tried) >= 5, tried  # gRPC's own: 3 (at 0, about 1 and 2.6 s)


def test_status_at_a_port_that_is_not_prometheus_is_one_line(capsys):
    """A gRPC port answers HTTP/2 frames to an HTTP/1 request: one error line, exit 1."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer() -> None:
        conn, _ = srv.accept()
        conn.recv(1024)
        conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    port = srv.getsockname()[1]
    try:
        assert run(["status", "--address", f"127.0.0.1:{port}", "--interval", "0.01"]) == 1
    finally:
        srv.close()
    err = capsys.readouterr().err
    assert err.startswith(f"error: no pdserve metrics at 127.0.0.1:{port}?"), err
    assert "a gRPC port?" in err and "--metrics-port" in err and "\\x00" not in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_complete_at_a_grpc_port_that_is_not_pdserves_main_one_says_so(capsys):
    """The admin port (or any gRPC server without pdserve's Generation service)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    srv = grpc.server(ThreadPoolExecutor(1))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        assert run(["complete", "--address", f"127.0.0.1:{port}", "--timeout", "10", "hi"]) == 1
    finally:
        srv.stop(0)
    err = capsys.readouterr().err
    assert "UNIMPLEMENTED" in err and "is it pdserve's main port?" in err and "--port" in err


def test_complete_at_an_http_port_says_it_answers_http(capsys):
    """pdserve's HTTP (OpenAI) or metrics port given to a gRPC command."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{srv.server_address[1]}"
        assert run(["complete", "--address", address, "--timeout", "10", "hi"]) == 1
    finally:
        srv.shutdown()
    err = capsys.readouterr().err
    assert "answers HTTP/1, not gRPC" in err and "--port, 50051" in err, err


def test_complete_interrupted_exits_130_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C while the answer streams: the text so far, then one line and exit 130."""
    from pdserve_proto import generation_pb2 as pb
    from pdserve_proto import generation_pb2_grpc as pb_grpc

    def answer(*args, **kwargs):
        yield pb.GenerateResponse(request_id="r", token_ids=[1], text="Par")
        raise KeyboardInterrupt

    class Stub:
        def __init__(self, channel):
            self.Generate = answer

    monkeypatch.setattr(pb_grpc, "GenerationStub", Stub)
    assert run(["complete", "--address", "127.0.0.1:1", "hi"]) == 130
    out = capsys.readouterr()
    assert out.out == "Par\n" and out.err == "interrupted\n"


def test_generate_interrupted_exits_130_without_a_traceback(monkeypatch, capsys):
    from engine.llm_engine import LLMEngine

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LLMEngine, "generate", interrupted)
    assert run(["generate", "--model", "tiny-llama", "--max-tokens", "2", "hi"]) == 130
    assert capsys.readouterr().err == "\ninterrupted\n"


@pytest.mark.parametrize(
    "argv",
    [["complete", "--address", "127.0.0.1:1", "ab\udcffc"],
     ["complete", "--address", "127.0.0.1:1", "--stop", "\udcff", "hi"],
     ["generate", "--model", "tiny-llama", "ab\udcffc"]],
)  # fmt: skip
def test_arguments_that_are_not_utf8_exit_2_naming_them(argv, capsys):
    """A shell argument of bytes that are not UTF-8 reaches Python as lone surrogates."""
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert "is not valid UTF-8" in err and "Traceback" not in err, err


def test_output_into_a_closed_pipe_ends_quietly_as_sigpipe_would():
    """`pdserve ... | head`: the reader left; no traceback, the exit status a shell gives."""
    import subprocess
    import sys
    from pathlib import Path

    argv = [sys.executable, "-m", "router.cli", "serve", "--print-config", "--model", "tiny-llama"]
    root = Path(__file__).resolve().parent.parent
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as most shells
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root, env=env)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before it prints
    err = p.stderr.read().decode()
    assert p.wait(60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_broken_pipe_that_is_not_the_output_s_is_not_taken_for_its_reader_leaving(monkeypatch):
    from router import cli

    def broken(args, extra):
        raise BrokenPipeError(32, "a worker's socket")

    monkeypatch.setattr(cli, "_complete", broken)
    with pytest.raises(BrokenPipeError, match="a worker's socket"):
        main(["complete", "hi"])


def test_status_interval_must_be_positive(capsys):
    assert run(["status", "--interval", "0"]) == 2
    assert "argument --interval: must be" in capsys.readouterr().err


def _subcommands():
    from router.cli import bench_parser, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: p for name, p in sub.choices.items() if name not in ("bench", "bench-engine")}
    return {**parsers, "bench": bench_parser()}


@pytest.mark.parametrize(
    "name", ["generate", "serve", "complete", "scale", "workers", "status", "bench"]
)
def test_every_option_with_a_default_says_it_in_its_help(name):
    parser = _subcommands()[name]
    text = parser.format_help()
    blocks = re.split(r"\n  (?=-)", text)  # one block per option, its help beside it
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        block = next(b for b in blocks if b.startswith(flag + " ") or b.startswith(flag + ","))
        default = action.default
        if name == "serve" and flag not in ("--config", "--print-config"):  # defaults in help
            default = serve_options.BY_NAME[action.dest].default
        if default in (None, False, [], {}, argparse.SUPPRESS):
            continue  # nothing, or off: the help says what giving it does
        assert "default" in block, f"pdserve {name} {flag}: {block!r}"
