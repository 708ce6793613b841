"""Can a split's prefill worker also decode some requests within the ITL SLO, on this host?

Two bare engines in two processes, one torch thread each, as a server's two workers on one node
(no router, no transfers: what the engines alone allow). Once both have loaded:
  - the "decode worker" keeps a batch of `--decode-batch` requests decoding `--output-len` tokens
    (one that ends is replaced at once): alone for `--warmup` s, then beside the other until
    it is done;
  - the "prefill worker" is then given the trace's prompts at `--rate` (Poisson, each stamped at
    its arrival) for `--duration` s, each prefilled for its first token (a handoff), except 1 in
    N, which it also decodes for `--output-len` tokens (a request the decode worker has no room
    for, decoded where it was prefilled), its steps sized by a step target where one is given;
    it then runs what it took to the end (within DRAIN_LIMIT_S), the decode worker beside it.

Each run (`--runs every:target_ms`; target 0 for none, every 0 for no decodes there) reports:
the prompts sent and served (a prompt not served within the drain counts its wait in the TTFT
max); of those decoded there, how many finished and how many of those passed `--slo-itl-ms` at
their p99 gap (a request not finished counts as missing it), with the median of the p99 gaps;
and the decode worker's median step while the prefill worker was running a step, over its
median step alone.

    .venv/bin/python scripts/prefiller_decodes.py --json out.json
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing as mp
import queue
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import trace  # noqa: E402
from engine.provenance import provenance, write_json  # noqa: E402

LOAD_TIMEOUT_S = 300.0  # for both engines to load
DRAIN_LIMIT_S = 120.0  # for the prefill worker to finish what it took, once arrivals stop


@dataclass(frozen=True)
class Run:
    every: int  # 1 in `every` requests also decodes on the prefill worker (0: none does)
    target_ms: float  # the prefill worker's step target (0: none)


@dataclass(frozen=True)
class DecodeLog:
    go: float  # time.time() when both had loaded: alone from here for the warm-up
    steps: list[tuple[float, float]]  # (start, end), time.time()


@dataclass(frozen=True)
class PrefillLog:
    sent: dict[str, float]  # request id -> its arrival, time.time()
    tokens: dict[str, list[float]]  # request id -> when each of its tokens came
    steps: list[tuple[float, float]]  # (start, end) of each step it ran
    end: float


@dataclass
class Row:
    every: int
    target_ms: float
    sent: int
    served: int  # prompts whose first token came
    ttft_p50_s: float  # over those served
    ttft_max_s: float  # also over those not served: their wait until the end
    decoded_there: int  # requests sent to decode there
    finished: int  # of those, decoded to the end
    over_slo: int  # of those sent, not finished or past the ITL SLO at their p99 gap
    p99_gap_ms: float | None  # the median over those finished of each one's p99 gap
    step_alone_ms: float  # the decode worker's median step alone
    step_beside_ms: float  # ... while the prefill worker was running a step
    slowdown: float = field(init=False)

    def __post_init__(self) -> None:
        self.slowdown = self.step_beside_ms / self.step_alone_ms


def _engine(model: str, target_s: float | None) -> Any:
    from engine.config import EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    scheduler = SchedulerConfig(step_target_s=target_s)
    model_config = ModelConfig(model=model, num_threads=1)
    return LLMEngine(EngineConfig(model=model_config, scheduler=scheduler))


def _prompt(e: Any, rnd: random.Random, n: int, output_len: int) -> list[int]:
    n = max(1, min(n, e.max_model_len - output_len - 1))  # a small model's context
    return [rnd.randrange(1, e.vocab_size) for _ in range(n)]


def _decode_worker(q: Any, ready: Any, done: Any, args: argparse.Namespace) -> None:
    from engine.sampling_params import SamplingParams

    e = _engine(args.model, None)
    rnd = random.Random(1)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    n = 0

    def add() -> None:
        nonlocal n
        e.add_request(_prompt(e, rnd, args.decode_prompt_len, args.output_len), sp, f"d{n}")
        n += 1

    for _ in range(args.decode_batch):
        add()
    ready.wait(LOAD_TIMEOUT_S)
    go = time.time()
    until = go + args.warmup + args.duration + DRAIN_LIMIT_S  # at the latest
    steps: list[tuple[float, float]] = []
    while time.time() < until and not done.is_set():
        t = time.time()
        outs = e.step()
        steps.append((t, time.time()))
        for o in outs:
            if o.finished:
                add()
    q.put(DecodeLog(go, steps))


def _prefill_worker(q: Any, ready: Any, done: Any, args: argparse.Namespace, run: Run) -> None:
    from engine.sampling_params import SamplingParams

    e = _engine(args.model, run.target_ms / 1000 if run.target_ms else None)
    reqs = trace.load(args.trace)
    rnd = random.Random(2)
    ready.wait(LOAD_TIMEOUT_S)
    t0 = time.time() + args.warmup
    while time.time() < t0:
        time.sleep(0.01)
    next_at, i = t0, 0
    sent: dict[str, float] = {}
    tokens: dict[str, list[float]] = {}
    steps: list[tuple[float, float]] = []
    # Prompts arrive for `duration` s; then what it has taken runs to its end (at most
    # DRAIN_LIMIT_S more), so that a request decoded there late in the run counts whole.
    while time.time() < t0 + args.duration + DRAIN_LIMIT_S:
        while time.time() >= next_at and next_at < t0 + args.duration:  # arrived meanwhile
            local = run.every > 0 and i % run.every == 0
            rid = f"{'L' if local else 'H'}{i}"
            sp = SamplingParams(
                max_tokens=args.output_len if local else 1, temperature=0.0, ignore_eos=True
            )
            n = reqs[i % len(reqs)].prompt_len
            e.add_request(_prompt(e, rnd, n, args.output_len), sp, rid)
            sent[rid] = next_at
            i += 1
            next_at += rnd.expovariate(args.rate)
        if not e.has_unfinished_requests():
            if next_at >= t0 + args.duration:
                break  # all arrived and served
            time.sleep(0.002)
            continue
        t = time.time()
        outs = e.step()
        steps.append((t, time.time()))
        for o in outs:
            tokens.setdefault(o.request_id, []).append(steps[-1][1])
    done.set()
    q.put(PrefillLog(sent, tokens, steps, time.time()))


def _overlapping(steps: list[tuple[float, float]], busy: list[tuple[float, float]]) -> list[float]:
    """The durations of `steps` whose middle falls inside one of `busy` (sorted, disjoint)."""
    starts = [a for a, _ in busy]
    out = []
    for a, b in steps:
        mid = (a + b) / 2
        k = bisect.bisect_right(starts, mid) - 1
        if k >= 0 and busy[k][1] >= mid:
            out.append(b - a)
    return out


def measure(args: argparse.Namespace, run: Run) -> Row:
    """One run: both processes, their logs, the figures."""
    ctx = mp.get_context("spawn")
    q, ready, done = ctx.Queue(), ctx.Barrier(2), ctx.Event()
    procs = [
        ctx.Process(target=_decode_worker, args=(q, ready, done, args), name="decode"),
        ctx.Process(target=_prefill_worker, args=(q, ready, done, args, run), name="prefill"),
    ]
    logs: list[Any] = []
    try:
        for p in procs:
            p.start()
        deadline = time.time() + LOAD_TIMEOUT_S + args.warmup + args.duration + DRAIN_LIMIT_S + 60
        while len(logs) < 2:
            try:
                logs.append(q.get(timeout=1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.time() > deadline:
                    why = ", ".join(f"{p.name} exited {p.exitcode}" for p in dead) or "timed out"
                    raise RuntimeError(f"the {run} run failed: {why}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    dec = next(x for x in logs if isinstance(x, DecodeLog))
    pre = next(x for x in logs if isinstance(x, PrefillLog))
    beside_at = dec.go + args.warmup
    # Alone: its second half of the warm-up (its batch's own prompts prefilled by then).
    alone = [b - a for a, b in dec.steps if dec.go + args.warmup / 2 <= a and b < beside_at]
    beside = _overlapping([s for s in dec.steps if s[0] >= beside_at], pre.steps)
    served = {r: ts[0] - pre.sent[r] for r, ts in pre.tokens.items()}
    waits = list(served.values()) + [pre.end - t for r, t in pre.sent.items() if r not in served]
    local = [r for r in pre.sent if r.startswith("L")]
    finished = [pre.tokens[r] for r in local if len(pre.tokens.get(r, ())) == args.output_len]
    p99s = [float(np.percentile(np.diff(ts), 99)) for ts in finished]
    slo = args.slo_itl_ms / 1000
    return Row(
        run.every,
        run.target_ms,
        len(pre.sent),
        len(served),
        statistics.median(served.values()) if served else float("nan"),
        max(waits) if waits else float("nan"),
        len(local),
        len(finished),
        len(local) - sum(p <= slo for p in p99s),
        statistics.median(p99s) * 1000 if p99s else None,
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
    lines = [
        f"{'decoded there':>13} {'target':>7} {'sent':>5} {'served':>6} {'TTFT p50':>9} "
        f"{'max':>7} {'decoded':>8} {'finished':>8} {f'miss {slo_itl_ms:.0f} ms':>12} "
        f"{'p99 gap':>8} {'decode worker':>14}"
    ]
    for r in rows:
        every = f"1 in {r.every}" if r.every else "none"
        target = f"{r.target_ms:.0f} ms" if r.target_ms else "none"
        gap = f"{r.p99_gap_ms:.0f} ms" if r.p99_gap_ms is not None else "-"
        over = f"{r.over_slo} of {r.decoded_there}" if r.decoded_there else "-"
        lines.append(
            f"{every:>13} {target:>7} {r.sent:>5} {r.served:>6} {r.ttft_p50_s:>8.2f}s "
            f"{r.ttft_max_s:>6.1f}s {r.decoded_there:>8} {r.finished:>8} {over:>12} {gap:>8} "
            f"{r.slowdown:>13.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/prefiller_decodes.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--runs", type=_runs, default=_runs("0:0,0:80,4:0,4:105,4:80,8:80"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--trace", default="mixed")
    p.add_argument("--rate", type=float, default=1.2)
    p.add_argument("--output-len", type=int, default=122)
    p.add_argument("--decode-batch", type=int, default=12)
    p.add_argument("--decode-prompt-len", type=int, default=173)
    p.add_argument("--slo-itl-ms", type=float, default=123.7)
    p.add_argument("--duration", type=float, default=50.0, help="seconds beside each other")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds the decode side is alone")
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
        write_json(args.json, {"args": settings, "rows": [asdict(r) for r in rows]}, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
