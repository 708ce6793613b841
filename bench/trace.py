"""Traces: what to send and when. One request per entry: arrival time (seconds at a mean rate of
1 request/s), prompt and output lengths, an optional shared prefix. Prompts are token ids drawn
with a fixed seed, so that every policy (and every run) sees the same tokens.

Sources: the built-in traces (bench/traces/*.jsonl, the format of their README), any such
JSON-lines file, ShareGPT-format JSON (first human turn as the prompt text, the reply's length
at ~4 characters a token as the output), or synthetic lengths with Poisson/gamma arrivals.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

TRACES = Path(__file__).with_name("traces")
BUILTIN = ("chat", "long-prompt", "mixed")
MAX_SHAREGPT_OUTPUT = 1024  # tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # at a mean rate of 1 request/s
    prompt_len: int
    output_len: int
    prefix_id: str | None = None
    prefix_len: int = 0
    prompt_text: str | None = None  # ShareGPT: sent as text, the server tokenizes


class TraceError(ValueError):
    """A trace file that cannot be read as one; the message names the file and the line (or
    the conversation) and the field."""


def load(
    name: str, num_requests: int | None = None, scale: float = 1.0, seed: int = 0
) -> list[TraceRequest]:
    """The trace `name` (built-in, or a file: `.json` is ShareGPT, anything else JSON lines),
    its first `num_requests`, every length times `scale` (JSON lines only: ShareGPT prompts are
    sent as text). `seed` draws ShareGPT's arrivals (JSON lines carry their own)."""
    path = TRACES / f"{name}.jsonl" if name in BUILTIN else Path(name)
    if not path.is_file():
        raise TraceError(f"no built-in trace {name!r} {BUILTIN} and no file {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise TraceError(f"{path}: line {line}: not UTF-8 ({exc.reason})") from None
    if path.suffix == ".json":
        if scale != 1.0:
            raise TraceError(f"{path}: --scale: ShareGPT prompts are sent as text, unscaled")
        reqs = _sharegpt(path, text, seed)
    else:
        reqs = [_entry(line, path, i) for i, line in enumerate(text.splitlines()) if line.strip()]
        for (i, a), (j, b) in zip(reqs, reqs[1:]):
            if b.arrival_s < a.arrival_s:
                raise TraceError(
                    f"{path}: line {j + 1}: arrival_s {b.arrival_s:g} is before line {i + 1}'s "
                    f"{a.arrival_s:g} (requests are sent in the file's order)"
                )
    out = [r for _, r in reqs][:num_requests]
    if not out:
        raise TraceError(f"{path}: no requests in it")
    if scale != 1.0:
        out = [
            replace(
                r,
                prompt_len=max(1, round(r.prompt_len * scale)),
                output_len=max(1, round(r.output_len * scale)),
                prefix_len=round(r.prefix_len * scale),
            )
            for r in out
        ]
    return out


def _entry(line: str, path: Path, i: int) -> tuple[int, TraceRequest]:
    """One JSON-lines entry (line `i`, from 0) with its line's index."""
    where = f"{path}: line {i + 1}"
    try:
        d = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(d, dict):
        raise TraceError(f"{where}: a JSON object is expected, got {type(d).__name__}")
    arrival = d.get("arrival_s")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
        raise TraceError(f"{where}: arrival_s: a number of seconds is expected, got {arrival!r}")
    if not (math.isfinite(arrival) and arrival >= 0):
        raise TraceError(f"{where}: arrival_s: must be finite and >= 0, got {arrival!r}")
    prefix_id = d.get("prefix_id")
    if isinstance(prefix_id, int) and not isinstance(prefix_id, bool):
        prefix_id = str(prefix_id)  # a number names a prefix as well
    if prefix_id is not None and not isinstance(prefix_id, str):
        raise TraceError(f"{where}: prefix_id: a string is expected, got {prefix_id!r}")
    req = TraceRequest(
        arrival_s=float(arrival),
        prompt_len=_tokens(d, "prompt_len", where, least=1),
        output_len=_tokens(d, "output_len", where, least=1),
        prefix_id=prefix_id,
        prefix_len=_tokens(d, "prefix_len", where, least=0, default=0),
    )
    if req.prefix_len > req.prompt_len:
        raise TraceError(
            f"{where}: prefix_len: {req.prefix_len} is longer than prompt_len {req.prompt_len}"
        )
    return i, req


def _tokens(d: dict, key: str, where: str, least: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if value is None:
        raise TraceError(f"{where}: {key}: missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TraceError(f"{where}: {key}: an integer >= {least} is expected, got {value!r}")
    return value


def _sharegpt(path: Path, text: str, seed: int) -> list[tuple[int, TraceRequest]]:
    """Each conversation's first human turn as the prompt text (its length estimated at ~4
    characters a token), its first reply's length as the output (at most MAX_SHAREGPT_OUTPUT
    tokens), Poisson arrivals drawn with `seed`. Conversations without both are skipped, and
    said to be."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (a JSON-lines trace? name it .jsonl)" if exc.msg == "Extra data" else ""
        raise TraceError(f"{path}: not JSON: {exc.msg}, line {exc.lineno}{hint}") from None
    if not isinstance(doc, list):
        raise TraceError(f"{path}: ShareGPT: a list of conversations is expected")
    out: list[tuple[int, TraceRequest]] = []
    rng = random.Random(seed)
    t, skipped, capped = 0.0, 0, 0
    for i, conv in enumerate(doc):
        turns = (conv.get("conversations") or []) if isinstance(conv, dict) else None
        if not isinstance(turns, list) or not all(
            isinstance(x, dict) and isinstance(x.get("value", ""), str) for x in turns
        ):
            raise TraceError(
                f"{path}: conversation {i}: conversations: a list of turns "
                '({"from": ..., "value": text}) is expected'
            )
        human = next((x.get("value") for x in turns if x.get("from") == "human"), None)
        reply = next((x.get("value") for x in turns if x.get("from") == "gpt"), None)
        if not human or not reply:
            skipped += 1
            continue
        t += rng.expovariate(1.0)
        capped += len(reply) // 4 > MAX_SHAREGPT_OUTPUT
        output = max(1, min(MAX_SHAREGPT_OUTPUT, len(reply) // 4))
        out.append((i, TraceRequest(t, max(1, len(human) // 4), output, prompt_text=human)))
    if skipped or capped:
        print(f"{path}: {skipped} conversations without a human turn and a reply skipped; "
              f"{capped} replies longer than {MAX_SHAREGPT_OUTPUT} tokens capped")  # fmt: skip
    return out


def synthetic(
    n: int,
    prompt: tuple[int, int],
    output: tuple[int, int],
    burstiness: float,
    seed: int,
    prefixes: tuple[int, int] | None = None,
) -> list[TraceRequest]:
    """Uniform lengths; gamma inter-arrival times of mean 1 s (shape `burstiness`: 1 is Poisson,
    below 1 burstier). `prefixes` (K, L): every prompt starts with one of K shared prefixes of
    L tokens, chosen at random (a system prompt), followed by its own `prompt` tokens; the
    arrivals and the other lengths are those of the same trace without them."""
    rng = random.Random(seed)
    pick = random.Random(f"{seed}:prefixes")
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / burstiness)
        req = TraceRequest(t, rng.randint(*prompt), rng.randint(*output))
        if prefixes is not None:
            count, length = prefixes
            which = f"system-{pick.randrange(count)}"
            req = replace(
                req, prompt_len=length + req.prompt_len, prefix_id=which, prefix_len=length
            )
        out.append(req)
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
