"""Traces: what to send and when. One request per entry: arrival time (seconds at a mean rate of
1 request/s), prompt and output lengths, an optional shared prefix. Prompts are token ids drawn
with a fixed seed, so that every policy (and every run) sees the same tokens.

Sources: the built-in traces (bench/traces/*.jsonl, the format of their README), any such
JSON-lines file, ShareGPT-format JSON (first human turn as the prompt text, the reply's length
at ~4 characters a token as the output), or synthetic lengths with Poisson/gamma arrivals.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

TRACES = Path(__file__).with_name("traces")
BUILTIN = ("chat", "long-prompt", "mixed")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # at a mean rate of 1 request/s
    prompt_len: int
    output_len: int
    prefix_id: str | None = None
    prefix_len: int = 0
    prompt_text: str | None = None  # ShareGPT: sent as text, the server tokenizes


def load(name: str, num_requests: int | None = None, scale: float = 1.0) -> list[TraceRequest]:
    path = TRACES / f"{name}.jsonl" if name in BUILTIN else Path(name)
    if not path.is_file():
        raise ValueError(f"--trace: no built-in trace {name!r} {BUILTIN} and no file {path}")
    text = path.read_text()
    if path.suffix == ".json":
        reqs = _sharegpt(json.loads(text))
    else:
        reqs = [
            _entry(json.loads(line), path, i)
            for i, line in enumerate(text.splitlines())
            if line.strip()
        ]
    reqs = reqs[:num_requests] if num_requests else reqs
    if scale != 1.0:
        reqs = [
            replace(
                r,
                prompt_len=max(1, round(r.prompt_len * scale)),
                output_len=max(1, round(r.output_len * scale)),
                prefix_len=round(r.prefix_len * scale),
            )
            for r in reqs
        ]
    return reqs


def _entry(d: dict, path: Path, i: int) -> TraceRequest:
    try:
        return TraceRequest(
            arrival_s=float(d["arrival_s"]),
            prompt_len=int(d["prompt_len"]),
            output_len=int(d["output_len"]),
            prefix_id=None if d.get("prefix_id") is None else str(d["prefix_id"]),
            prefix_len=int(d.get("prefix_len", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: line {i + 1}: {exc!r}") from exc


def _sharegpt(doc: list[dict]) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    rng = random.Random(0)
    t = 0.0
    for conv in doc:
        turns = conv.get("conversations") or []
        human = next((x["value"] for x in turns if x.get("from") == "human"), None)
        reply = next((x["value"] for x in turns if x.get("from") == "gpt"), None)
        if not human or not reply:
            continue
        t += rng.expovariate(1.0)
        out.append(
            TraceRequest(t, max(1, len(human) // 4), max(1, min(1024, len(reply) // 4)),
                         prompt_text=human)
        )  # fmt: skip
    return out


def synthetic(
    n: int, prompt: tuple[int, int], output: tuple[int, int], burstiness: float, seed: int
) -> list[TraceRequest]:
    """Uniform lengths; gamma inter-arrival times of mean 1 s (shape `burstiness`: 1 is Poisson,
    below 1 burstier)."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / burstiness)
        out.append(TraceRequest(t, rng.randint(*prompt), rng.randint(*output)))
    return out


def prompt_ids(req: TraceRequest, index: int, vocab: int, seed: int) -> list[int]:
    """The request's prompt tokens: its shared prefix (drawn from the prefix id) then its own."""
    ids: list[int] = []
    if req.prefix_id is not None and req.prefix_len:
        pre = random.Random(zlib.crc32(f"{seed}:{req.prefix_id}".encode()))
        ids = [pre.randrange(vocab) for _ in range(min(req.prefix_len, req.prompt_len))]
    own = random.Random(seed * 1_000_003 + index)
    ids += [own.randrange(vocab) for _ in range(req.prompt_len - len(ids))]
    return ids
