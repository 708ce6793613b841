"""`pdserve bench`'s command line: its options, each value checked as argparse reads it, and
the checks across them made before any server starts (`refused`)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from bench import overload, trace
from bench.server import POLICIES
from pdserve_client import add_arguments as add_auth_arguments
from pdserve_client.argtypes import (
    address,
    auto_or,
    count,
    flag_set,
    float_at_least,
    int_at_least,
    positive_float,
    seconds,
)


def lengths(text: str) -> tuple[int, int]:
    """An argparse type: token lengths A:B (or A), 1 <= A <= B."""
    a, _, b = text.partition(":")
    try:
        low, high = int(a), int(b or a)
    except ValueError:
        raise argparse.ArgumentTypeError(f"A:B token lengths expected, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"A:B with 1 <= A <= B expected, got {text!r}")
    return low, high


def prefixes(text: str) -> tuple[int, int]:
    """An argparse type: K:L, K shared prefixes of L tokens, K and L at least 1."""
    k, sep, n = text.partition(":")
    try:
        count, length = int(k), int(n)
    except ValueError:
        count = length = 0
    if not sep or count < 1 or length < 1:
        raise argparse.ArgumentTypeError(
            f"K:L (K prefixes of L tokens, both >= 1) expected, got {text!r}"
        )
    return count, length


def rates(text: str) -> list[float]:
    """An argparse type: comma-separated offered rates, each finite and > 0, sorted ascending."""
    rates = [positive_float(v) for v in text.split(",") if v.strip()]
    if not rates or not all(math.isfinite(r) for r in rates):
        raise argparse.ArgumentTypeError(f"finite requests/s > 0, comma-separated, got {text!r}")
    return sorted(set(rates))


# The synthetic trace's options and their defaults: given where no synthetic trace is sent (a
# trace file; the overload run's Poisson arrivals for --burstiness), refused.
SYNTHETIC: dict[str, Any] = {
    "prompt_len": (32, 512),
    "output_len": (16, 128),
    "burstiness": 1.0,
    "prefixes": None,
}


def unused_synthetic(args: argparse.Namespace) -> str | None:
    """Why a synthetic trace's option given is not used (None: each given is)."""
    if args.overload is not None:
        if args.burstiness != SYNTHETIC["burstiness"]:
            return "--burstiness: the overload run's arrivals are Poisson (burstiness 1)"
        return None
    if args.trace == "synthetic":
        return None
    flag = flag_set(args, SYNTHETIC)
    if flag is None:
        return None
    return (
        f"{flag}: an option of the synthetic trace, so it needs --trace synthetic (or --overload)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        type=address(50051),
        default=None,
        help="measure a running server as it is (labelled by the first --policy, else 'server')",
    )
    p.add_argument(
        "--metrics-address",
        type=address(9400),
        default=None,
        metavar="HOST:PORT",
        help="with --address: that server's metrics endpoint, to report how busy each worker "
        "was over the run (the servers the bench starts are read without it)",
    )
    add_auth_arguments(p)  # for a running server that asks for TLS or a token
    p.add_argument(
        "--trace", default="mixed", help=f"{trace.BUILTIN}, a .jsonl/.json file, or synthetic"
    )
    p.add_argument(
        "--num-requests",
        type=int_at_least(1),
        default=None,
        help="the first N requests (default: all; synthetic: 100)",
    )
    p.add_argument(
        "--rate", type=positive_float, default=1.0, help="requests/s (trace arrivals / rate)"
    )
    p.add_argument(
        "--scale",
        type=positive_float,
        default=1.0,
        help="multiply every length (JSON-lines traces; synthetic: set --prompt-len and "
        "--output-len)",
    )
    p.add_argument(
        "--burstiness",
        type=positive_float,
        default=SYNTHETIC["burstiness"],
        help="synthetic: gamma shape of the inter-arrival times (1: Poisson; below 1 burstier)",
    )
    p.add_argument(
        "--prompt-len",
        type=lengths,
        default=SYNTHETIC["prompt_len"],
        help="synthetic and --overload: A:B (default: 32:512)",
    )
    p.add_argument(
        "--output-len",
        type=lengths,
        default=SYNTHETIC["output_len"],
        help="synthetic and --overload: A:B (default: 16:128)",
    )
    p.add_argument(
        "--prefixes",
        type=prefixes,
        default=SYNTHETIC["prefixes"],
        metavar="K:L",
        help="synthetic and --overload: every prompt starts with one of K shared prefixes of L "
        "tokens (system prompts), chosen at random; --prompt-len sets the rest",
    )
    p.add_argument(
        "--policy",
        default=None,
        help=f"comma-separated (default: {','.join(POLICIES)}; with --overload one, default auto)",
    )
    p.add_argument("--model", default="smollm2-135m", help="the servers' --model")
    p.add_argument("--prefill", type=count, default=1, help="prefill workers of fixed pools")
    p.add_argument("--decode", type=count, default=1, help="decode workers of fixed pools")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads per worker")
    p.add_argument("--kv-cache-gib", type=positive_float, default=1.0, help="per CPU worker")
    p.add_argument(
        "--gpus-per-worker",
        type=float_at_least(0),
        default=None,
        help="--gpus-per-worker for the servers (default: theirs, 1 where CUDA is present); "
        "a fraction shares one GPU among workers",
    )
    p.add_argument(
        "--threshold-tokens",
        type=count,
        default=512,
        help="threshold policy: prompts with more uncached tokens go disaggregated",
    )
    p.add_argument(
        "--threshold-queue",
        type=count,
        default=4,
        help="threshold policy: ...while the prefill queue holds fewer requests",
    )
    p.add_argument(
        "--step-target-ms",
        type=auto_or(positive_float),
        default=None,
        help="--step-target-ms for the servers of chunked policies (chunk sizing next to "
        "decodes); auto: each worker's tuned from the ITL p99 its requests see",
    )
    p.add_argument(
        "--prefill-hold-ms",
        type=auto_or(float_at_least(0)),
        default=None,
        help="--prefill-hold-ms for the servers given --step-target-ms (a prompt waits for "
        "running decodes where no chunk beside them keeps to the step target); auto: a share "
        "(half) of each request's TTFT SLO",
    )
    p.add_argument(
        "--slo-ttft",
        type=positive_float,
        default=None,
        help="seconds (default: measured, see above)",
    )
    p.add_argument(
        "--slo-itl",
        type=positive_float,
        default=None,
        help="seconds (default: measured, see above)",
    )
    p.add_argument(
        "--slo-itl-metric",
        choices=["itl_p99", "tpot"],
        default="itl_p99",
        help="what --slo-itl bounds",
    )
    p.add_argument(
        "--slo-ttft-scale",
        type=positive_float,
        default=3.0,
        help="measured SLO: x TTFT measured alone",
    )
    p.add_argument(
        "--slo-itl-scale",
        type=positive_float,
        default=2.0,
        help="measured SLO: x ITL measured alone",
    )
    p.add_argument(
        "--long-prompt", type=int_at_least(1), default=512, help="prompts this long are 'long'"
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the decode-only baseline")
    p.add_argument(
        "--no-slo-hint",
        action="store_true",
        help="do not tell the server each request's SLO (by default it is sent, for admission "
        "and the auto policy, the same for every policy)",
    )
    p.add_argument(
        "--sweep-rate", action="store_true", help="per policy: highest rate at >= 90%% attainment"
    )
    p.add_argument(
        "--sweep-rates",
        type=rates,
        default=None,
        metavar="R1,R2,...",
        help="with --sweep-rate: probe these offered rates (req/s), the same for every policy, "
        "in place of a binary search between --rate / 4 and --rate x 4 (a search probes other "
        "rates per policy, and assumes attainment falls with the rate)",
    )
    p.add_argument(
        "--repeat",
        type=int_at_least(1),
        default=1,
        help="run the policies this many times (each round in another order), and report each "
        "one's goodput and ratio to the best fixed policy of the same round, per round",
    )
    p.add_argument(
        "--warmup",
        type=count,
        default=0,
        metavar="N",
        help="before each server's measured run, its first N requests with other prompts, at "
        "--rate and with the SLO hint, so that every policy is measured after its router has "
        "seen the workload (step times, transfers); 0: one short request",
    )
    p.add_argument("--seed", type=int, default=0, help="of the trace and of sampling")
    p.add_argument("--timeout", type=seconds, default=900.0, help="per request, seconds")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="folder for PNGs")
    overload.add_arguments(p)


def refused(args: argparse.Namespace, policies: list[str]) -> str | None:
    """What is wrong with the command line, checked before any server starts (None: nothing)."""
    if args.metrics_address and (not args.address or args.overload is not None):
        return ("--metrics-address: the metrics of a running server measured with its trace "
                "(--address, without --overload); the servers the bench starts are read without "
                "it")  # fmt: skip
    if args.json:
        folder = Path(args.json).resolve().parent
        if Path(args.json).is_dir():
            return f"--json: {args.json} is a folder; name the file to write"
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            return f"--json: {folder} is not a folder this bench can write to"
    unused = unused_synthetic(args)
    if unused is not None:
        return unused
    alone = overload.given_alone(args)
    if alone is not None:
        return f"{alone}: an option of the overload run, so it needs --overload F"
    if args.overload is None:  # bench/overload.py checks its own
        if not policies:
            return f"--policy: no policy named in {args.policy!r}; choose from {list(POLICIES)}"
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            return f"--policy: unknown {unknown}; choose from {list(POLICIES)}"
        if args.prefill_hold_ms and args.step_target_ms is None:  # 0: as its default
            return ("--prefill-hold-ms: prompts wait where a chunk cannot keep to the step "
                    "target, so it needs --step-target-ms")  # fmt: skip
        if args.sweep_rates and not args.sweep_rate:
            return "--sweep-rates: the rates a sweep probes, so it needs --sweep-rate"
    if args.plot:  # made last: a refused command leaves no folder behind
        try:
            Path(args.plot).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--plot: {args.plot}: {exc.strerror or exc}"
    return None
