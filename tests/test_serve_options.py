"""`pdserve serve --config FILE`: every option from a YAML file, flags over the file, and a bad
file refused before anything starts, naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from router import effective_options, serve_options
from router.cli import main
from router.workers import Placement
from worker_protocol.messages import WorkerRole


def write(tmp_path, text: str):
    path = tmp_path / "pdserve.yaml"
    path.write_text(text)
    return path


def effective(tmp_path, text: str, *flags: str, capsys) -> dict:
    path = write(tmp_path, text)
    tiny = [] if "model:" in text else ["--model", "tiny-llama"]  # print-config checks it
    assert main(["serve", "--config", str(path), *tiny, *flags, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_yaml_anchors_and_merge_keys_are_read_as_yaml_reads_them(tmp_path, capsys):
    got = effective(
        tmp_path,
        "prefill_resources: &pool {pool: 1, zone_a: 1}\ndecode_resources: {<<: *pool, zone_a: 2}\n",
        capsys=capsys,
    )
    assert got["decode_resources"] == {"pool": 1.0, "zone_a": 2.0}


def test_the_file_sets_options_and_flags_override_it(tmp_path, capsys):
    got = effective(
        tmp_path,
        "model: tiny-llama\nprefill: 2\ndecode: 3\nprefill-resources: {prefill_node: 1}\n"
        "decode_resources: '{\"decode_node\": 2}'\npolicy: threshold\nport: 6000\n"
        "chunked_prefill: false\n",
        "--decode", "4", "--port", "6001",
        capsys=capsys,
    )  # fmt: skip
    assert got["model"] == "tiny-llama" and got["prefill"] == 2
    assert got["decode"] == 4 and got["port"] == 6001  # the flags win
    assert got["prefill_resources"] == {"prefill_node": 1.0}
    assert got["decode_resources"] == {"decode_node": 2.0}
    assert got["policy"] == "threshold" and got["chunked_prefill"] is False
    assert got["metrics_port"] == 9400  # not in the file, not a flag: the default
    # Every option is printed, so the output is itself a complete config file.
    assert set(got) == set(serve_options.BY_NAME)
    again = effective(tmp_path, yaml.safe_dump(got), capsys=capsys)
    assert again == got


def test_the_effective_options_reach_the_server_config(tmp_path):
    path = write(
        tmp_path,
        "prefill: 0\ndecode: 2\ngpus_per_worker: 0.5\nprefill_resources: {a: 1}\n"
        "kv_interface: eth1\nslo_itl_ms: 150\nmax_num_seqs: 8\nadmin_port: -1\n"
        "replace_dead_workers: false\nstep_target_ms: 120\nprefill_hold_ms: 2500\n"
        "kv_backend: gloo\n",
    )
    args = _parse(["serve", "--config", str(path), "--threads", "2", "--seed", "7"])
    config = effective_options.resolve(args).serve_config()
    c = config.cluster
    assert (c.num_prefill, c.num_decode, c.threads_per_worker) == (0, 2, 2)
    assert c.kv_interface == "eth1" and c.replace_dead is False
    assert c.pool_config().spec.kv_backend == "gloo"  # every worker's spec carries it
    assert c.pool_config().spec.engine.model.sampling_seed == 7
    placement = c.pool_config().placement
    assert placement[WorkerRole.PREFILL] == Placement(0.5, (("a", 1.0),))
    assert placement[WorkerRole.DECODE] == Placement(0.5, ())
    assert c.engine.scheduler.max_num_seqs == 8
    assert c.engine.scheduler.step_target_s == pytest.approx(0.12)
    assert c.engine.scheduler.prefill_hold_s == pytest.approx(2.5)
    assert config.router.slo_itl_s == pytest.approx(0.15)
    assert config.admin_port is None


class Built(Exception):
    """Raised in place of building an engine: carries the config a worker would build."""


@pytest.mark.parametrize("seed", [None, 7])
def test_each_worker_draws_unseeded_requests_seeds_from_its_own_stream(monkeypatch, seed):
    """`--seed` reaches every worker, which draws from a seed of its own (worker id and
    incarnation): two workers, or a worker and its replacement, never hand out the same seeds."""
    from decode_worker.worker import DecodeWorker
    from worker_protocol import host

    def build(config):
        raise Built(config)

    monkeypatch.setattr(host, "LLMEngine", build)
    argv = ["serve", "--model", "tiny-llama"] + ([] if seed is None else ["--seed", str(seed)])
    spec = effective_options.resolve(_parse(argv)).serve_config().cluster.pool_config().spec
    got = {}
    for worker_id, incarnation in (("decode-0", 0), ("decode-1", 0), ("decode-0", 1)):
        with pytest.raises(Built) as built:
            DecodeWorker(worker_id, spec, incarnation)
        got[worker_id, incarnation] = built.value.args[0].model.sampling_seed
    if seed is None:
        assert set(got.values()) == {None}  # each drawn from the OS's randomness
    else:
        assert len(set(got.values())) == 3, got
        assert got["decode-1", 0] == host.worker_sampling_seed(7, "decode-1", 0)  # repeatable


def test_a_hold_of_auto_is_a_share_of_each_requests_ttft_slo(tmp_path):
    """`prefill_hold_ms: auto`: the router gives each placement HOLD_SHARE of its request's TTFT
    SLO; the workers' own hold (for a request that brings none) is that share of the default."""
    path = write(tmp_path, "step_target_ms: auto\nprefill_hold_ms: AUTO\nslo_ttft_ms: 8000\n")
    config = effective_options.resolve(_parse(["serve", "--config", str(path)])).serve_config()
    assert config.router.prefill_hold_share == serve_options.HOLD_SHARE == 0.5
    assert config.cluster.engine.scheduler.prefill_hold_s == pytest.approx(4.0)
    plain = effective_options.resolve(_parse(["serve", "--step-target-ms", "100"])).serve_config()
    assert plain.router.prefill_hold_share is None
    assert plain.cluster.engine.scheduler.prefill_hold_s is None


def _parse(argv):
    from router.cli import build_parser

    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    "text, field",
    [
        ("decode: 0\n", "decode (--decode): need at least 1 worker that decodes"),
        ("decode: 0\nworkers: -1\n", "workers: must be an integer >= 0"),
        ("decod: 2\n", "unknown field 'decod' (did you mean 'decode'?)"),
        ("prefill: two\n", "prefill: must be an integer >= 0"),
        ("policy: fastest\n", "policy: must be one of auto"),
        ("port: 70000\n", "port: must be an integer >= 0 and <= 65535"),
        ("prefill_resources: {node: -1}\n", "prefill_resources: node: must be a number > 0"),
        ("decode_resources: {GPU: 1}\n", "decode_resources: 'GPU' is set by other options"),
        ("slo_ttft_ms: .nan\n", "slo_ttft_ms: must be a number > 0"),
        ("chunked_prefill: maybe\n", "chunked_prefill: must be true or false"),
        ("worker_hang_timeout: 2\n", "worker_hang_timeout: must be a number >= 3, got 2 (or 0"),
        ("- decode\n", "must be a mapping of option names to values"),
        ("model: [1\n", "not valid YAML"),
        ("prefill: 2\ndecode: 1\nprefill: 3\n", "field 'prefill' is given twice"),
        ("step_target_ms: 100\nchunked_prefill: false\n", "step_target_ms"),
        ("prefill_hold_ms: 3000\n", "prefill_hold_ms"),
        ("step_target_ms: 100\nprefill_hold_ms: soon\n", "prefill_hold_ms: must be a number"),
        ("max_num_batched_tokens: 8\n", "(--max-num-batched-tokens): must be >= max_num_seqs"),
        ("log_level: loud\n", "log_level: must be one of debug, info, warning, error"),
        ("max_num_seqs: 4\nmax-num-seqs: 8\n", "field 'max-num-seqs' is given twice"),
        ("drain_timeout: 1:30\n", "drain_timeout: must be a number >= 0, got '1:30'"),
        ("drain_timeout: 1:30.5\n", "drain_timeout: must be a number >= 0, got '1:30.5'"),
        ("dtype: fp8\n", "dtype: must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    ],
)
def test_a_bad_file_is_refused_at_start_naming_the_field(tmp_path, capsys, text, field):
    path = write(tmp_path, text)
    assert main(["serve", "--config", str(path)]) == 2  # before Ray or a model is touched
    err = capsys.readouterr().err
    cross = any(f in err for f in ("step_target_ms", "--decode", "--max-num-batched"))  # x-field
    assert err.startswith(f"error: config {path}: ") or cross, err
    assert field in err, err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--max-num-batched-tokens", "1"], "must be >= max_num_seqs"),
        (["--max-num-seqs", "300", "--max-num-batched-tokens", "256"], "must be >= max_num_seqs"),
        (
            ["--tls-cert", "cert.pem"],
            "tls_cert and tls_key (--tls-cert, --tls-key): give both or neither",
        ),
        (["--auth-token-file", "/no/such/token"], "/no/such/token"),
        (["--gpus-per-worker", "1.5"], "gpus_per_worker (--gpus-per-worker): Ray shares"),
        (["--metrics-port", "50071", "--port", "50071"], "metrics_port (--metrics-port): 50071"),
        (["--http-port", "50051"], "http_port (--http-port): 50051 is --port's too"),
        (["--model", "no-such-model"], "model 'no-such-model' not found"),
    ],
)
def test_print_config_refuses_what_serve_refuses(capsys, flags, says):
    """A printed config is one that `serve` takes: the same checks run first."""
    assert main(["serve", *flags, "--print-config"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and says in out.err, out.err
    # (ports of their own where the flags name none: a server may hold the defaults)
    free = (
        []
        if any(f.endswith("-port") for f in flags)
        else ["--port", "0", "--admin-port", "-1", "--metrics-port", "-1"]
    )
    assert main(["serve", *flags, *free]) == 2 and says in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("prefill: 2\n# caf\u00e9\n".encode("latin-1"))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config {path}: not UTF-8 text (invalid continuation byte"), err


def test_integers_are_read_as_yaml_1_2_reads_them(tmp_path, capsys):
    """A leading zero is no octal (YAML 1.1 read 050051 as 20521); 0o and 0x say their base.
    Only option names are taken in either spelling: Ray resources are as written."""
    got = effective(
        tmp_path,
        "port: 050051\nthreads: 0x2\nmax_num_seqs: 0o10\nslo_itl_ms: 1.5e2\n"
        "prefill_resources: {zone-a: 1, zone_a: 2}\n",
        capsys=capsys,
    )
    assert (got["port"], got["threads"], got["max_num_seqs"]) == (50051, 2, 8)
    assert got["slo_itl_ms"] == 150.0
    assert got["prefill_resources"] == {"zone-a": 1.0, "zone_a": 2.0}


def test_words_in_any_case_other_dtype_spellings_and_a_home_path_are_taken(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "token").write_text("a-token-of-twenty-characters\n")
    got = effective(
        tmp_path,
        "dtype: FP16\nlog_level: INFO\npolicy: Threshold\nkv_backend: GLOO\n"
        "kv_failure_policy: Fail\nprefill_hold_ms: 0\nauth_token_file: ~/token\n",
        capsys=capsys,
    )
    assert (got["dtype"], got["log_level"], got["policy"]) == ("float16", "info", "threshold")
    assert (got["kv_backend"], got["kv_failure_policy"]) == ("gloo", "fail")
    assert got["prefill_hold_ms"] is None  # 0: as its default, prompts never wait
    assert got["auth_token_file"] == str(tmp_path / "token")
    assert effective(tmp_path, "", "--dtype", "half", capsys=capsys)["dtype"] == "float16"


def test_a_relative_path_in_a_file_is_the_files_neighbour(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "token").write_text("a-token-of-twenty-characters\n")
    path = folder / "pdserve.yaml"
    path.write_text("auth_token_file: token\nmodel: tiny-llama\n")
    monkeypatch.chdir(tmp_path)  # serve runs elsewhere, given the file's path relative to it
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert main(["serve", "--config", "conf/pdserve.yaml", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["auth_token_file"] == str(folder / "token")
    # What serve joins, where the file says nothing of it:
    assert "# ray_address null: RAY_ADDRESS=10.0.0.9:6379 is joined" in out


def test_help_lists_the_words_an_option_takes_and_no_flag_is_abbreviated(capsys):
    assert main_exit(["serve", "--help"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert '(one of auto, colocated, disaggregated, threshold; default: "auto")' in said
    assert "one of auto, float32, bfloat16, float16; also float, fp32, half, fp16, bf16" in said
    assert main_exit(["serve", "--max-num-seq", "4", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "pdserve serve: error: unrecognized arguments: --max-num-seq 4" in err, err


def test_print_config_prints_while_a_server_holds_the_ports(tmp_path, capsys):
    """A port in use is the moment, not the config: an operator asks while a server runs."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        got = effective(tmp_path, "", "--port", str(port), capsys=capsys)
        assert got["port"] == port
        assert main(["serve", "--model", "tiny-llama", "--port", str(port)]) == 2  # serve: no
        assert f"--port: 127.0.0.1:{port} is taken" in capsys.readouterr().err


def test_a_missing_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["serve", "--config", str(missing)]) == 2
    assert f"config {missing}: cannot be read" in capsys.readouterr().err


def test_a_bad_flag_names_the_flag(capsys):
    assert main_exit(["serve", "--prefill-resources", '{"a": "x"}']) == 2
    assert "--prefill-resources: a: must be a number > 0" in capsys.readouterr().err


def main_exit(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)


@pytest.mark.timeout(60)
def test_print_config_as_a_user_runs_it(tmp_path):
    path = write(tmp_path, "decode: 2\nmodel: tiny-llama\n")
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--print-config"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["decode"] == 2


def test_workers_that_do_both_may_stand_in_for_the_decode_pool(tmp_path, capsys):
    got = effective(tmp_path, "decode: 0\nworkers: 2\n", "--prefill", "0", capsys=capsys)
    assert (got["prefill"], got["decode"], got["workers"]) == (0, 0, 2)
    config = effective_options.resolve(_parse(["serve", "--decode", "0", "--workers", "3"]))
    cluster = config.serve_config().cluster
    assert (cluster.num_decode, cluster.num_both) == (0, 3)


def test_an_auto_step_target_starts_under_the_itl_slo_and_is_tuned_by_the_router():
    config = effective_options.resolve(
        _parse(["serve", "--step-target-ms", "auto", "--slo-itl-ms", "150"])
    ).serve_config()
    assert config.cluster.engine.scheduler.step_target_s == pytest.approx(0.12)
    assert config.router.tune_step_target
    fixed = effective_options.resolve(_parse(["serve", "--step-target-ms", "100"])).serve_config()
    assert not fixed.router.tune_step_target
    with pytest.raises(effective_options.OptionError, match="chunked_prefill"):
        effective_options.resolve(
            _parse(["serve", "--step-target-ms", "auto", "--no-chunked-prefill"])
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level, shown", [("info", {"INFO-LINE", "WARN-LINE"}),
                                          ("warning", {"WARN-LINE"})])  # fmt: skip
def test_log_level_sets_what_the_server_logs(level, shown):
    import subprocess
    import sys

    script = (
        "import logging, sys\n"
        "import router.serve_signals\n"
        "async def serve(config):\n"
        "    log = logging.getLogger('pdserve.router')\n"
        "    log.info('INFO-LINE')\n"
        "    log.warning('WARN-LINE')\n"
        "router.serve_signals.serve = serve\n"
        "from router.cli import main\n"
        "sys.exit(main(['serve', '--metrics-port', '-1', '--port', '0', '--admin-port', '-1',\n"
        "                '--log-level', sys.argv[1]]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, level], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    assert {w for w in ("INFO-LINE", "WARN-LINE") if w in out.stderr} == shown, out.stderr


def test_a_model_folder_in_the_file_is_the_files_and_the_served_name_is_its_own(tmp_path):
    """A relative `model` in the file is a folder (or .gguf file) beside the file, wherever serve
    runs, as the file's other paths are; a built-in name stays a name. `served_model_name`, from
    the file or a flag, is the name the APIs give; none: the model as the file names it."""
    conf = tmp_path / "etc"
    conf.mkdir()
    path = conf / "pdserve.yaml"
    path.write_text("model: models/my-llama\nserved_model_name: llama-small\n")
    config = effective_options.resolve(_parse(["serve", "--config", str(path)])).serve_config()
    assert config.cluster.model == str(conf / "models" / "my-llama")
    assert config.served_model_name == config.model_name == "llama-small"
    flagged = _parse(["serve", "--config", str(path), "--served-model-name", "other"])
    assert effective_options.resolve(flagged).serve_config().model_name == "other"
    path.write_text("model: models/my-llama\n")  # no name: served as the file names it
    config = effective_options.resolve(_parse(["serve", "--config", str(path)])).serve_config()
    assert config.cluster.model == str(conf / "models" / "my-llama")
    assert config.model_name == "models/my-llama"
    flagged = _parse(["serve", "--config", str(path), "--model", "tiny-qwen2"])  # a flag's own
    assert effective_options.resolve(flagged).serve_config().model_name == "tiny-qwen2"
    path.write_text("model: tiny-llama\n")
    config = effective_options.resolve(_parse(["serve", "--config", str(path)])).serve_config()
    assert config.cluster.model == config.model_name == "tiny-llama"
    assert config.served_model_name is None
    path.write_text("model: /abs/m.gguf\nserved_model_name: ''\n")
    config = effective_options.resolve(_parse(["serve", "--config", str(path)])).serve_config()
    assert config.cluster.model == config.model_name == "/abs/m.gguf"  # '' is none
