"""`pdserve bench-engine`: one process, one run, the same requests through four systems.

  pdserve        the engine (paged KV, token-budget scheduler, batched decodes);
  hf_sequential  transformers `generate`, one request at a time;
  hf_continuous  transformers' own continuous batching (`generate_batch`), where it exists;
  bare_forward   the engine's recorded step shapes replayed on the bare model with contiguous KV
                 (the limit: no scheduler, no paging, no sampling).

Requests: prompts of 128-512 random tokens, 128 output tokens each, greedy, EOS ignored. Every
system produces token ids; the engine runs as the workers run it, without decoding text (the
router detokenizes), unless `--detokenize` asks for text deltas too.

Here are the command line, the rounds and the table; each system's timed run is
engine/bench_systems.py's (bare_forward's replay, engine/bare_forward.py's).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.bare_forward import replay
from engine.bench_systems import hf_continuous, hf_sequential, run_pdserve, timed
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.dtype_names import DTYPE_ALIASES, DTYPE_CHOICES, canonical_dtype
from engine.loader import load_model
from engine.provenance import provenance, write_json
from engine.sampling_params import SamplingParams


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _dtype(word: str) -> str:
    try:
        return canonical_dtype(word)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf")
    p.add_argument("--requests", type=_positive, default=64, help="requests, all sent at once")
    p.add_argument(
        "--min-prompt", type=_positive, default=128, help="shortest prompt, in random tokens"
    )
    p.add_argument("--max-prompt", type=_positive, default=512, help="longest prompt")
    p.add_argument(
        "--output-tokens", type=_positive, default=128, help="tokens each request generates"
    )
    p.add_argument("--max-num-seqs", type=_positive, default=64, help="the engine's batch")
    p.add_argument(
        "--max-num-batched-tokens", type=_positive, default=512, help="the engine's step budget"
    )
    p.add_argument(
        "--threads", type=_positive, default=None, help="torch threads (default: all cores)"
    )
    p.add_argument(
        "--hf-sequential-requests",
        type=_positive,
        default=None,
        help="run one-at-a-time transformers on every k-th request only, k = requests / this "
        "(it is the slowest system; tokens/s stays comparable)",
    )
    p.add_argument("--skip", default="", help="comma-separated systems not to run")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "paged"])
    p.add_argument(
        "--dtype",
        default="auto",
        type=_dtype,
        help=f"one of {', '.join(DTYPE_CHOICES)} (also {', '.join(DTYPE_ALIASES)}); auto: the "
        "checkpoint's own dtype on CUDA, float32 on CPU; the transformers baselines run in the "
        "same dtype",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs for decode steps (CPU runs are always eager)",
    )
    p.add_argument(
        "--detokenize",
        action="store_true",
        help="the engine also decodes each request's text as it steps (the workers don't: the "
        "router detokenizes)",
    )
    p.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="run pdserve and bare_forward this many times, alternating, each round on a fresh "
        "engine; the table shows each round's ratio and the median (a noisy machine moves single "
        "runs by 20%%)",
    )
    p.add_argument(
        "--penalties",
        action="store_true",
        help="in each round, also run the engine with every request penalized (repetition 1.1, "
        "presence 0.5, frequency 0.5): pdserve_penalized, its cost beside pdserve",
    )
    p.add_argument("--seed", type=int, default=0, help="of the prompts")
    p.add_argument("--json", default=None, help="write results to this file")


def check(args: argparse.Namespace) -> None:
    """What is wrong with the command line, found before the model loads: ValueError naming
    the flag."""
    if args.min_prompt > args.max_prompt:
        raise ValueError(f"--min-prompt {args.min_prompt} is above --max-prompt {args.max_prompt}")
    if args.max_num_seqs > args.max_num_batched_tokens:
        raise ValueError(
            f"--max-num-seqs {args.max_num_seqs} is above --max-num-batched-tokens "
            f"{args.max_num_batched_tokens} (each running request takes a token of a step)"
        )
    if args.json:
        folder = Path(args.json).resolve().parent
        if Path(args.json).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ValueError(f"--json: {args.json}: not a file in a folder this can write to")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = 0 if vocab <= 1024 else 1000  # keep clear of special tokens in large vocabularies
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [
        torch.randint(low, min(vocab, 256) if vocab <= 1024 else vocab, (k,), generator=g).tolist()
        for k in lens
    ]


def prepare(args: argparse.Namespace) -> tuple[dict[str, Any], ModelConfig, Any]:
    """How the run was made (provenance, at its start), the model's config and the model,
    loaded; ValueError (naming the flag) for bad input, found before the benchmark runs."""
    made = provenance()  # at the start: when it started, from which checkout
    check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_cfg = ModelConfig(
        model=args.model,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )
    loaded = load_model(model_cfg)  # in the dtype the engine runs in, for the baselines too
    context = getattr(loaded.hf_model.config, "max_position_embeddings", None)
    if context is not None and args.max_prompt + args.output_tokens > context:
        raise ValueError(
            f"--max-prompt {args.max_prompt} + --output-tokens {args.output_tokens} is past "
            f"{args.model}'s context of {context} tokens"
        )
    return made, model_cfg, loaded


def run(args: argparse.Namespace, prepared: Any = None) -> int:
    made, model_cfg, loaded = prepared or prepare(args)
    model = loaded.hf_model
    prompts = make_prompts(
        args.requests, args.min_prompt, args.max_prompt, model.config.vocab_size, args.seed
    )
    n_out = args.output_tokens
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    cfg = EngineConfig(
        model=model_cfg,
        cache=CacheConfig(cpu_kv_cache_gib=4.0),
        scheduler=SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, True),
        detokenize=args.detokenize,
    )
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    systems: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, dict[str, Any]]] = []  # per round: system -> result
    for _ in range(max(1, args.rounds)):
        engine_run, steps, paged_model = run_pdserve(cfg, loaded, prompts, params)
        if "error" in engine_run:  # nothing to compare the others with
            raise RuntimeError(f"the engine failed: {engine_run['error']}")
        runs.append({"pdserve": engine_run})
        if "bare_forward" not in skip and steps:
            secs = replay(paged_model, steps)
            toks = engine_run.get("output_tokens", 0)
            runs[-1]["bare_forward"] = {
                "output_tok_s": toks / secs,
                "seconds": secs,
                "output_tokens": toks,
            }
        del paged_model
        _free_caches()
        if args.penalties:  # after the first engine's cache is freed: sized as that one was
            penalized = replace(params, repetition_penalty=1.1, presence_penalty=0.5,
                                frequency_penalty=0.5)  # fmt: skip
            runs[-1]["pdserve_penalized"], _, unused = run_pdserve(cfg, loaded, prompts, penalized)
            del unused
            _free_caches()
            if "error" in runs[-1]["pdserve_penalized"]:
                raise RuntimeError(f"the penalized run failed: {runs[-1]['pdserve_penalized']}")
    rounds = [{name: r["output_tok_s"] for name, r in run.items()} for run in runs]
    for r in rounds:
        if "bare_forward" in r:
            r["ratio"] = r["pdserve"] / r["bare_forward"]
        if "pdserve_penalized" in r:
            r["penalized_ratio"] = r["pdserve_penalized"] / r["pdserve"]
    # The table shows the median round (by the ratio, or by pdserve's rate alone; of an even
    # number, the lower of the middle two, as the printed median is).
    key = "ratio" if "ratio" in rounds[0] else "pdserve"
    order = sorted(range(len(rounds)), key=lambda i: rounds[i][key])
    systems.update(runs[order[(len(order) - 1) // 2]])

    if "hf_continuous" not in skip:
        systems["hf_continuous"] = timed(lambda: hf_continuous(model, prompts, n_out))
    if "hf_sequential" not in skip:
        k = args.hf_sequential_requests
        subset = prompts if not k else prompts[:: max(1, len(prompts) // k)][:k]
        systems["hf_sequential"] = timed(lambda: hf_sequential(model, subset, n_out))
        systems["hf_sequential"]["requests"] = len(subset)

    result = {
        "model": args.model,
        "dtype": str(model.dtype).removeprefix("torch."),
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens_per_request": n_out,
        "threads": torch.get_num_threads(),
        "detokenize": args.detokenize,
        "systems": systems,
        "rounds": rounds,
    }
    print_table(result)
    if args.json:
        write_json(args.json, result, made)
    return 0


def print_table(result: dict[str, Any]) -> None:
    sy = result["systems"]
    base = sy.get("pdserve", {}).get("output_tok_s")
    text = "on" if result.get("detokenize") else "off"
    print(
        f"\nmodel {result['model']}, {result['requests']} requests, {result['threads']} threads, "
        f"engine detokenizing: {text}"
    )
    print(f"{'system':<18}{'tok/s':>10}{'seconds':>10}{'pdserve / system':>18}")
    for name in ("pdserve", "pdserve_penalized", "hf_sequential", "hf_continuous", "bare_forward"):
        r = sy.get(name)
        if r is None:
            continue
        if "error" in r:
            print(f"{name:<18}{'error: ' + r['error'][:60]}")
            continue
        ratio = f"{base / r['output_tok_s']:.2f}x" if base else "-"
        print(f"{name:<18}{r['output_tok_s']:>10.1f}{r['seconds']:>10.1f}{ratio:>18}")
    ratios = [r["ratio"] for r in result.get("rounds", ()) if "ratio" in r]
    if len(ratios) > 1:
        each = ", ".join(f"{x:.2f}" for x in ratios)
        low = statistics.median_low(ratios)
        print(f"pdserve / bare_forward per round: {each}; median {low:.2f}x")
    penalized = [r["penalized_ratio"] for r in result.get("rounds", ()) if "penalized_ratio" in r]
    if penalized:
        each = ", ".join(f"{x:.3f}" for x in penalized)
        print(f"pdserve_penalized / pdserve per round: {each}; median "
              f"{statistics.median_low(penalized):.3f}x")  # fmt: skip


def _free_caches() -> None:
    """The last engine's KV cache given back, whatever cycle may still hold it, so that the next
    engine's cache (sized from the free memory on a GPU) is sized as that one's was."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-engine", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        prepared = prepare(args)
    except ValueError as exc:  # bad input, the flag named
        p.error(str(exc))
    return run(args, prepared)


if __name__ == "__main__":
    raise SystemExit(main())
