"""Host time per engine step at 8, 64 and 256 running requests.

    python -m engine.step_overhead_bench [--json FILE]


For each batch size, N requests are prefilled, then every one of them decodes at once; the timed
steps are those decode-only steps. One step splits into:

  schedule   the scheduler's `schedule()`;
  prepare    the runner filling its preallocated step buffers (engine/step_inputs.py);
  forward    the model's forward (on CPU: its compute; on CUDA: the time to launch its kernels);
  sample     the rest of the runner's `execute` (sampling and the copy of the ids back);
  post       the engine's work after the runner (request state, outputs, stats; detokenizing
             too with --detokenize: the workers run without it, the router decodes text).

host = step - forward: everything the device does not need. `lists` is the same step's inputs
built the way the runner built them before the buffers (Python lists of every token, position and
block, then fresh tensors), timed inside the same steps on the same schedules, for comparison
(and left out of the other columns). Medians over the steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.outputs import SchedulerOutput
from engine.provenance import provenance, write_json
from engine.sampling_params import SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "post")


class _Timer:
    """A callable that accumulates the seconds spent in `fn` during the current step."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def _timed(owner: Any, name: str) -> _Timer:
    """Time a method of one object (an instance attribute shadowing the method)."""
    timer = _Timer(getattr(owner, name))
    setattr(owner, name, timer)
    return timer


def prepare_from_lists(so: SchedulerOutput, block_size: int, device: torch.device) -> int:
    """The former per-step preparation, for comparison: Python lists over every token and every
    block of the step, then new tensors (and on CUDA one copy each). Returns the token count."""
    decodes = [s for s in so.scheduled if len(s.token_ids) == 1]
    chunks = [s for s in so.scheduled if len(s.token_ids) > 1]
    order = decodes + chunks
    ids: list[int] = []
    pos: list[int] = []
    for s in order:
        ids.extend(s.token_ids)
        pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
    max_nb = max((len(s.block_ids) for s in decodes), default=0)
    table = [list(s.block_ids) + [0] * (max_nb - len(s.block_ids)) for s in decodes]
    ctx = [s.start_pos + 1 for s in decodes]
    block_of = [
        s.block_ids[p // block_size]
        for s in order
        for p in range(s.start_pos, s.start_pos + len(s.token_ids))
    ]
    positions = torch.tensor(pos, dtype=torch.long, device=device)
    torch.tensor(table, dtype=torch.long, device=device).view(len(decodes), max_nb)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    if decodes and min(ctx) != max_nb * block_size:
        _ = torch.arange(max_nb * block_size, device=device)[None, :] < ctx_t[:, None]
    for s in chunks:
        torch.tensor(s.block_ids, device=device)
    torch.tensor(block_of, dtype=torch.long, device=device)
    _ = positions % block_size
    rows, row = [], 0
    for s in order:
        row += len(s.token_ids)
        if s.sample:
            rows.append(row - 1)
    torch.tensor(rows, dtype=torch.long, device=device)
    return len(torch.tensor(ids, dtype=torch.long, device=device))


def measure(
    loaded: Any,
    model: str,
    n: int,
    prompt_len: int,
    steps: int,
    block_size: int,
    detokenize: bool = False,
) -> dict[str, Any]:
    cfg = EngineConfig(
        model=ModelConfig(model=model),
        cache=CacheConfig(block_size=block_size, cpu_kv_cache_gib=4.0),
        scheduler=SchedulerConfig(max(1024, n), n, True),
        detokenize=detokenize,
    )
    engine = LLMEngine(cfg, loaded)
    runner = engine.runner
    vocab = min(engine.vocab_size, 256)
    g = torch.Generator().manual_seed(n)
    warmup = 3
    # Enough tokens that no request ends before the timed steps do (they are aborted after).
    params = SamplingParams(
        max_tokens=engine.max_model_len - prompt_len - 1, temperature=0.0, ignore_eos=True
    )
    for _ in range(n):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    while (
        any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()  # prefill (not timed)

    timers = {
        "schedule": _timed(engine.scheduler, "schedule"),
        "execute": _timed(runner, "execute"),
        "prepare": _timed(runner.inputs, "prepare"),
        "forward": _timed(runner.model, "forward"),
    }
    # Each step's schedule is also prepared the former way, just before the runner's own
    # preparation, inside the same step (same caches, same schedules); its time is taken out
    # of the step's.
    lists = _Timer(prepare_from_lists)
    prepare = timers["prepare"].fn

    def both(so: SchedulerOutput, pad_to: int | None = None) -> Any:
        lists(so, block_size, runner.device)
        return prepare(so, pad_to)

    timers["prepare"].fn = both
    rows: list[dict[str, float]] = []
    ctx: list[int] = []
    for i in range(warmup + steps):
        for t in (*timers.values(), lists):
            t.seconds = 0.0
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0 - lists.seconds
        if i < warmup:
            continue
        sec = {k: t.seconds for k, t in timers.items()}
        sec["prepare"] -= lists.seconds
        sec["execute"] -= lists.seconds
        rows.append(
            {
                "schedule": sec["schedule"],
                "prepare": sec["prepare"],
                "forward": sec["forward"],
                "sample": sec["execute"] - sec["prepare"] - sec["forward"],
                "post": total - sec["schedule"] - sec["execute"],
                "step": total,
                "host": total - sec["forward"],
                "lists": lists.seconds,
            }
        )
    running = engine.scheduler.running
    assert len(running) == n and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
    ctx = [r.num_computed_tokens for r in running]
    engine.abort([r.request_id for r in list(running)])
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "running": n,
        "device": str(runner.device),
        "context_mean": sum(ctx) / len(ctx),
        "blocks_per_request": -(-max(ctx) // block_size),
        "steps": len(rows),
        "attention_backend": runner.attention.name,
        "median_ms": {k: v * 1e3 for k, v in med.items()},
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\nhost time per decode step, {result['model']} on {result['device']} "
        f"({result['attention_backend']} attention), "
        f"{result['threads']} threads, prompts of {result['prompt_len']} tokens, "
        f"block size {result['block_size']}, detokenizing {'on' if result['detokenize'] else 'off'}"
        f"; medians over {result['steps']} steps, ms"
    )
    cols = ["running", *PHASES, "step", "host", "lists"]
    print("".join(f"{c:>10}" for c in cols))
    for r in result["rows"]:
        m = r["median_ms"]
        cells = [f"{r['running']:>10}"] + [f"{m[c]:>10.3f}" for c in cols[1:]]
        print("".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.step_overhead_bench", description=__doc__)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--running", default="8,64,256", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--detokenize",
        action="store_true",
        help="the engine also decodes text at each step (workers don't: the router does)",
    )
    p.add_argument("--json", default=None, help="write results to this file")
    args = p.parse_args(argv)
    made = provenance()  # at the start: when it started, from which checkout
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(model=args.model))
    sizes = [int(x) for x in args.running.split(",") if x.strip()]
    rows = [
        measure(
            loaded, args.model, n, args.prompt_len, args.steps, args.block_size, args.detokenize
        )
        for n in sizes
    ]
    result = {
        "model": args.model,
        "device": rows[0]["device"],
        "attention_backend": rows[0]["attention_backend"],
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "block_size": args.block_size,
        "steps": args.steps,
        "detokenize": args.detokenize,
        "rows": rows,
    }
    print_table(result)
    if args.json:
        write_json(args.json, result, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
