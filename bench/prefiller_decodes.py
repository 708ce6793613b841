"""Can a split's prefill worker also decode some requests within the ITL SLO, on this host?

Two bare engines in two processes, one torch thread each, as a server's two workers on one node
(no router, no transfers: what the engines alone allow):
  - the "decode worker" keeps a batch of `--decode-batch` requests decoding `--output-len` tokens
    (one ending is replaced at once), and times its steps alone for `--warmup` s, then beside
    the other;
  - the "prefill worker" is given the trace's prompts at `--rate` (Poisson) for `--duration` s,
    each prefilled for its first token (a handoff), except every Nth, which it also decodes for
    `--output-len` tokens (the placement tried: a request the decode worker has no room for,
    decoded where it was prefilled), its steps sized by a step target where one is given.

Each run (`--runs every:target_ms`, target 0 for none, every 0 for no decodes) reports the
prefiller's decodes' p99 gap against `--slo-itl-ms` (the median over them, and how many pass
it), the TTFT of everything it prefilled, and how much slower the decode worker's median step
ran beside it than alone.

    python -m bench.prefiller_decodes --runs 0:0,4:0,4:105,4:80,8:80 --json out.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench import trace
from engine.provenance import provenance, write_json


@dataclass(frozen=True)
class Run:
    every: int  # every Nth request also decodes on the prefiller (0: none does)
    target_ms: float  # the prefiller's step target (0: none)


@dataclass
class Row:
    every: int
    target_ms: float
    sent: int
    ttft_p50_s: float
    ttft_max_s: float
    local_decodes: int
    local_p99_gap_ms: float | None  # the median over its decodes of each one's p99 gap
    local_over_slo: int
    decode_step_alone_ms: float
    decode_step_beside_ms: float

    @property
    def slowdown(self) -> float:
        return self.decode_step_beside_ms / self.decode_step_alone_ms


def _engine(model: str, target_s: float | None) -> Any:
    from engine.config import EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    scheduler = SchedulerConfig(step_target_s=target_s)
    return LLMEngine(
        EngineConfig(model=ModelConfig(model=model, num_threads=1), scheduler=scheduler)
    )


def _prompt(e: Any, rnd: random.Random, n: int) -> list[int]:
    n = max(1, min(n, e.max_model_len - OUTPUT_ROOM))
    return [rnd.randrange(1, e.vocab_size) for _ in range(n)]


OUTPUT_ROOM = 160  # tokens of context kept for a request's output, for a small model's limit


def _decode_worker(q: Any, args: argparse.Namespace, beside_at: float, until: float) -> None:
    from engine.sampling_params import SamplingParams

    e = _engine(args.model, None)
    rnd = random.Random(1)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    n = 0

    def add() -> None:
        nonlocal n
        e.add_request(_prompt(e, rnd, args.decode_prompt_len), sp, f"d{n}")
        n += 1

    for _ in range(args.decode_batch):
        add()
    steps: list[tuple[float, float]] = []  # (when it ended, seconds)
    while time.time() < until:
        t = time.perf_counter()
        outs = e.step()
        steps.append((time.time(), time.perf_counter() - t))
        for o in outs:
            if o.finished:
                add()
    q.put(("decode", steps))


def _prefill_worker(q: Any, args: argparse.Namespace, run: Run, start_at: float) -> None:
    from engine.sampling_params import SamplingParams

    e = _engine(args.model, run.target_ms / 1000 if run.target_ms else None)
    reqs = trace.load(args.trace, None)
    rnd = random.Random(2)
    while time.time() < start_at:
        time.sleep(0.01)
    t0 = time.time()
    next_at, i = t0, 0
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[float]] = {}
    while time.time() < t0 + args.duration:
        now = time.time()
        while now >= next_at:
            local = run.every > 0 and i % run.every == 0
            rid = f"{'L' if local else 'H'}{i}"
            n = reqs[i % len(reqs)].prompt_len
            mt = args.output_len if local else 1
            sp = SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True)
            e.add_request(_prompt(e, rnd, n), sp, rid)
            sent[rid] = now
            i += 1
            next_at += rnd.expovariate(args.rate)
        if not e.has_unfinished_requests():
            time.sleep(0.002)
            continue
        for o in e.step():
            t = time.time()
            first.setdefault(o.request_id, t)
            tokens.setdefault(o.request_id, []).append(t)
    q.put(("prefill", sent, first, tokens))


def measure(args: argparse.Namespace, run: Run) -> Row:
    """One run: both processes, the decode worker alone for `args.warmup` s, then beside."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    beside_at = time.time() + args.startup + args.warmup
    until = beside_at + args.duration
    procs = [
        ctx.Process(target=_decode_worker, args=(q, args, beside_at, until)),
        ctx.Process(target=_prefill_worker, args=(q, args, run, beside_at)),
    ]
    for p in procs:
        p.start()
    got: dict[str, tuple] = {}
    deadline = until + args.startup + 120
    while len(got) < 2:
        kind, *rest = q.get(timeout=max(1.0, deadline - time.time()))
        got[kind] = tuple(rest)
    for p in procs:
        p.join(timeout=30)
    (steps,) = got["decode"]
    # Alone: after its batch's own prefills; beside: once the prefiller's first prompts came.
    alone = [s for t, s in steps if beside_at - args.warmup / 2 < t < beside_at - 0.5]
    settle, tail = min(3.0, args.duration / 4), min(1.0, args.duration / 8)
    beside = [s for t, s in steps if beside_at + settle < t < until - tail]
    sent, first, tokens = got["prefill"]
    ttft = [first[r] - sent[r] for r in first]
    p99s = [
        float(np.percentile(np.diff(ts), 99))
        for r, ts in tokens.items()
        if r.startswith("L") and len(ts) > args.output_len // 2
    ]
    slo = args.slo_itl_ms / 1000
    return Row(
        run.every,
        run.target_ms,
        len(sent),
        statistics.median(ttft) if ttft else float("nan"),
        max(ttft) if ttft else float("nan"),
        len(p99s),
        statistics.median(p99s) * 1000 if p99s else None,
        sum(p > slo for p in p99s),
        statistics.median(alone) * 1000 if alone else float("nan"),
        statistics.median(beside) * 1000 if beside else float("nan"),
    )


def _runs(text: str) -> list[Run]:
    try:
        return [Run(int(a), float(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--runs: expected every:target_ms pairs such as 0:0,4:80, got {text!r}"
        ) from exc


def table(rows: list[Row], slo_itl_ms: float) -> str:
    head = (
        f"{'decodes there':>14} {'step target':>11} {'sent':>5} {'TTFT p50':>9} {'max':>7} "
        f"{'decoded':>8} {'p99 gap':>8} {f'over {slo_itl_ms:.0f} ms':>12} {'decode worker':>14}"
    )
    lines = [head]
    for r in rows:
        every = f"1 in {r.every}" if r.every else "none"
        target = f"{r.target_ms:.0f} ms" if r.target_ms else "none"
        gap = f"{r.local_p99_gap_ms:.0f} ms" if r.local_p99_gap_ms is not None else "-"
        over = f"{r.local_over_slo} of {r.local_decodes}" if r.local_decodes else "-"
        lines.append(
            f"{every:>14} {target:>11} {r.sent:>5} {r.ttft_p50_s:>8.2f}s {r.ttft_max_s:>6.1f}s "
            f"{r.local_decodes:>8} {gap:>8} {over:>12} {r.slowdown:>13.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.prefiller_decodes",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--runs", type=_runs, default=_runs("0:0,4:0,4:105,4:80,8:80"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--trace", default="mixed")
    p.add_argument("--rate", type=float, default=1.2)
    p.add_argument("--output-len", type=int, default=122)
    p.add_argument("--decode-batch", type=int, default=12)
    p.add_argument("--decode-prompt-len", type=int, default=173)
    p.add_argument("--slo-itl-ms", type=float, default=123.0)
    p.add_argument("--duration", type=float, default=50.0, help="seconds beside each other")
    p.add_argument(
        "--warmup", type=float, default=10.0, help="seconds the decode worker runs alone"
    )
    p.add_argument("--startup", type=float, default=15.0, help="seconds to load both engines")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    made = provenance()
    rows: list[Row] = []
    for run in args.runs:
        rows.append(measure(args, run))
        lines = table(rows, args.slo_itl_ms).splitlines()
        print("\n".join(lines if len(rows) == 1 else lines[-1:]), flush=True)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "runs"}
        runs = [dict(asdict(r), slowdown=r.slowdown) for r in rows]
        write_json(args.json, {"args": settings, "rows": runs}, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
