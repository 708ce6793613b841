"""`pdserve bench-engine` on bad input: one `error:` line naming the flag, exit 2, before the
benchmark runs (and before the model loads where the flags alone say it)."""

from __future__ import annotations

import pytest

from router.cli import main

TINY = ["bench-engine", "--model", "tiny-llama", "--skip", "hf_sequential,hf_continuous"]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--min-prompt", "50", "--max-prompt", "10"], "error: --min-prompt 50 is above"),
        (["--max-num-seqs", "600"], "error: --max-num-seqs 600 is above --max-num-batched"),
        (["--json", "/no/such/folder/x.json"], "error: --json: /no/such/folder/x.json"),
        (["--model", "no-such-model"], "error: "),
        (["--min-prompt", "5000", "--max-prompt", "5000"], "error: --max-prompt 5000"),
    ],
)
def test_bad_input_is_one_error_line(argv, said, capsys):
    assert main([*TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", ["--requests", "--output-tokens", "--threads", "--rounds"])
def test_counts_below_one_are_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*TINY, flag, "0"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be an integer >= 1" in capsys.readouterr().err


def test_a_dtype_is_taken_in_the_spellings_serve_takes(capsys):
    import argparse

    from engine import bench_engine

    p = argparse.ArgumentParser()
    bench_engine.add_arguments(p)
    assert [p.parse_args(["--dtype", w]).dtype for w in ("BF16", "half", "auto")] == [
        "bfloat16", "float16", "auto"
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        main([*TINY, "--dtype", "fp8"])
    assert "argument --dtype: must be one of auto, float32" in capsys.readouterr().err
