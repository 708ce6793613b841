"""The decode-step roofline sweep (run for real on a lent GPU by scripts/gpu-check.sh) works end
to end on CPU with a tiny shape: its byte count and its fractions are consistent."""

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from engine import decode_sweep
from engine.decode_sweep import SHAPES, decode_step, sweep


def test_a_decode_step_gives_each_request_its_own_blocks():
    so = decode_step(batch=3, context=10, block_size=4)
    tables = [s.block_ids for s in so.scheduled]
    assert [len(t) for t in tables] == [3, 3, 3]
    assert len({b for t in tables for b in t}) == 9
    assert all(s.start_pos == 9 and s.token_ids == (1,) for s in so.scheduled)


def _tiny_args(chunk: int) -> Namespace:
    """A short sweep of the tiny shape on CPU: batches 1 and 4 at context 24."""
    return Namespace(
        shape="tiny", batches=[1, 4], context=24, dtype="float32", device="cpu",
        attention_backend="auto", enforce_eager=False, steps=2, warmup=1, copy_bytes=1 << 20,
        chunk=chunk,
    )  # fmt: skip


def test_the_sweep_reports_every_batch_on_cpu():
    res = sweep(_tiny_args(chunk=0))
    assert all("with_chunk_ms" not in r for r in res["rows"])
    shape = SHAPES["tiny"]
    kv = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * 16 * 4  # head_dim 16
    assert res["kv_bytes_per_token"] == kv
    assert [r["batch"] for r in res["rows"]] == [1, 4]
    for r in res["rows"]:
        assert r["step_ms"] > 0 and 0 < r["roofline_fraction"]
        assert r["bytes_read"] == res["weight_bytes"] + r["batch"] * 24 * kv


def test_a_chunk_beside_the_decodes_has_blocks_of_its_own_and_samples_nothing():
    so = decode_step(batch=2, context=10, block_size=4, chunk=5)
    *decodes, prompt = so.scheduled
    assert len(decodes) == 2 and so.num_batched_tokens == 7
    assert prompt.token_ids == (1,) * 5 and prompt.start_pos == 10 and not prompt.sample
    assert len(prompt.block_ids) == 4  # positions 0..14 at 4 a block
    assert not set(prompt.block_ids) & {b for d in decodes for b in d.block_ids}


def test_the_sweep_times_a_chunk_beside_each_batch(monkeypatch):
    built = []

    def spy(batch, context, block_size, chunk=0):
        built.append((batch, chunk))
        return decode_step(batch, context, block_size, chunk)

    monkeypatch.setattr(decode_sweep, "decode_step", spy)
    res = sweep(_tiny_args(chunk=32))
    # Each batch alone, then beside the chunk (the largest batch's step one row more than the
    # decodes alone: the runner's buffers grow for it).
    assert built == [(1, 0), (1, 32), (4, 0), (4, 32)]
    assert res["chunk"] == 32
    for r in res["rows"]:
        assert r["with_chunk_ms"] > 0
        assert r["chunk_slowdown"] == pytest.approx(r["with_chunk_ms"] / r["step_ms"])


@pytest.mark.parametrize("bad", ["-1", "1", "x"])
def test_a_chunk_of_one_token_or_fewer_is_refused_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit):
        decode_sweep.main(["--chunk", bad])
    assert "--chunk" in capsys.readouterr().err


def test_its_json_says_how_it_was_made(monkeypatch, tmp_path):
    """As every benchmark's (engine/provenance.py): the command line, the commit, the host and
    the start, then the figures."""
    out = tmp_path / "sweep.json"
    argv = ["--shape", "tiny", "--batches", "1", "--context", "24", "--device", "cpu", "--steps",
            "1", "--warmup", "0", "--copy-bytes", "1048576", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["python", "-m", "engine.decode_sweep", *argv])
    events = []  # how it was made is read as the run starts, before the sweep

    def spy(name):
        real = getattr(decode_sweep, name)

        def called(*args):
            events.append(name)
            return real(*args)

        return called

    for name in ("provenance", "sweep"):
        monkeypatch.setattr(decode_sweep, name, spy(name))
    assert decode_sweep.main(argv) == 0
    assert events == ["provenance", "sweep"]
    doc = json.loads(out.read_text())
    assert list(doc)[:5] == ["command", "commit", "changed", "host", "started"]
    assert doc["command"].endswith("--json " + str(out))
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(decode_sweep.__file__).parent,
                          capture_output=True, text=True)  # fmt: skip
    assert doc["commit"] == (here.stdout.strip() if here.returncode == 0 else None)
    assert [r["batch"] for r in doc["rows"]] == [1] and doc["rows"][0]["step_ms"] > 0
