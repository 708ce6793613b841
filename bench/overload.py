"""`pdserve bench --overload F`: open-loop load at F times what the server sustains, and how it
is shed. One policy, one server (its own, or `--address`).

1. Capacity: `--capacity R` requests/s, or measured: a closed loop of `--capacity-clients`
   clients, each sending its next request as soon as its last one has ended (no SLO hint), for
   `--capacity-duration` s; R = its output tokens/s over the last two thirds of that window over
   the mean output length of a request.
2. Overload: Poisson arrivals at F x R for `--duration` s, synthetic lengths (`--prompt-len`,
   `--output-len`, `--prefixes`), every request with its SLO hint, so that the router can refuse
   at once what it cannot serve in time.
3. Every request sent ends as exactly one of: completed (all its tokens), rejected
   (RESOURCE_EXHAUSTED with `retry-after-ms`), rejected without `retry-after-ms` (an error),
   failed with another status, or lost (no answer by its deadline, `--timeout`: DEADLINE_EXCEEDED
   at the client, or nothing at all).
4. Every `--sample-every` s: the RSS of the router process and of each worker process (a server
   this bench started: the router's pid, the workers' from its admin port), the requests the
   client sees waiting for their first token (the router's admission queue plus any on the wire)
   and in flight, and the router's own queue where the probe can read it (in-process servers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import loadgen, session, slo, trace
from bench.loadgen import RequestResult
from bench.overload_books import LOST, Overload, Sample, figures, outcome, report
from bench.server import POLICIES, Deployment, ServerProcess
from pdserve_client import ClientAuth
from pdserve_client.argtypes import flag_set, int_at_least, positive_float

log = logging.getLogger("pdserve.bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("overload (--overload F)")
    g.add_argument(
        "--overload",
        type=positive_float,
        default=None,
        metavar="F",
        help="open-loop Poisson load at F x the server's sustained rate, then how it was shed",
    )
    g.add_argument(
        "--capacity", type=positive_float, default=None, help="req/s (default: measured)"
    )
    g.add_argument("--capacity-clients", type=int_at_least(1), default=DEFAULTS["capacity_clients"],
                   help="closed loop that measures it")  # fmt: skip
    g.add_argument("--capacity-duration", type=positive_float,
                   default=DEFAULTS["capacity_duration"], help="seconds")  # fmt: skip
    g.add_argument("--duration", type=positive_float, default=DEFAULTS["duration"],
                   help="seconds of overload")  # fmt: skip
    g.add_argument("--sample-every", type=positive_float, default=DEFAULTS["sample_every"],
                   help="seconds between samples")  # fmt: skip
    g.add_argument("--max-pending", type=int_at_least(1), default=None,
                   help="the own server's --max-pending")  # fmt: skip


# The overload options (but --overload) and their defaults: given without --overload, refused.
DEFAULTS = {"capacity": None, "capacity_clients": 8, "capacity_duration": 40.0, "duration": 60.0,
            "sample_every": 2.0, "max_pending": None}  # fmt: skip


def given_alone(args: argparse.Namespace) -> str | None:
    """The flag of an overload option set without --overload (None: none is)."""
    return None if args.overload is not None else flag_set(args, DEFAULTS)


# -- what is sampled ----------------------------------------------------------------------------
async def _no_pids() -> dict[str, int]:
    return {}


def _unknown() -> int | None:
    return None


@dataclass(frozen=True, slots=True)
class Probe:
    """Where the sampler looks: the processes to measure (asked at every sample: a replaced
    worker has a new pid) and the router's queue of requests waiting for a first token."""

    pids: Callable[[], Awaitable[dict[str, int]]] = _no_pids
    pending: Callable[[], int | None] = _unknown


def _rss(pids: dict[str, int]) -> dict[str, int]:
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            out[name] = psutil.Process(pid).memory_info().rss
    return out


async def _sample(probe: Probe, sent: Sequence[RequestResult], t0: float) -> Sample:
    try:
        pids = await probe.pids()
    except Exception as exc:  # a worker mid-restart, the admin port busy: sample what is known
        log.warning("overload: could not list the processes: %s", exc)
        pids = {}
    waiting = sum(1 for r in sent if _open(r) and r.ttft_s is None)
    return Sample(
        time.monotonic() - t0,
        _rss(pids),
        waiting,
        sum(1 for r in sent if _open(r)),
        probe.pending(),
    )


def _open(r: RequestResult) -> bool:
    return r.status == "OK" and r.e2e_s is None


# -- the run -------------------------------------------------------------------------------------
async def overload(
    address: str,
    reqs: Sequence[trace.TraceRequest],
    rate: float,
    vocab: int,
    seed: int,
    timeout: float,
    hint: tuple[float, float] | None,
    auth: ClientAuth | None = None,
    probe: Probe | None = None,
    every_s: float = 2.0,
) -> Overload:
    """Send `reqs` open loop at `rate` (arrival_s / rate), sampling every `every_s` s, and one
    last time once every request has ended. A request still without an answer past its deadline
    and a grace period is booked LOST."""
    probe = probe or Probe()
    out = Overload([], planned=len(reqs))
    t0 = time.monotonic()
    out.samples.append(await _sample(probe, out.results, t0))

    async def sampler() -> None:
        while True:
            await asyncio.sleep(every_s)
            out.samples.append(await _sample(probe, out.results, t0))

    task = asyncio.ensure_future(sampler())
    last = max((r.arrival_s for r in reqs), default=0.0) / rate
    try:
        await asyncio.wait_for(
            loadgen.run(
                address, reqs, rate, vocab, seed, timeout, None, hint, auth, out.results.append
            ),
            last + timeout + 30,
        )
    except TimeoutError:
        for r in out.results:
            if _open(r):
                r.status = LOST
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    out.samples.append(await _sample(probe, out.results, t0))
    return out


def arrivals(
    rate: float,
    duration_s: float,
    prompt: tuple[int, int],
    output: tuple[int, int],
    seed: int,
    prefixes: tuple[int, int] | None = None,
) -> list[trace.TraceRequest]:
    """Poisson arrivals (at a mean of 1/s, as traces are; send them at `rate`) that fall inside
    `duration_s` at that rate; `prefixes` as trace.synthetic's."""
    n = int(rate * duration_s * 1.5) + 20
    while True:
        reqs = trace.synthetic(n, prompt, output, 1.0, seed, prefixes)
        if reqs[-1].arrival_s / rate >= duration_s:
            return [r for r in reqs if r.arrival_s / rate < duration_s]
        n *= 2


# -- the command ---------------------------------------------------------------------------------
def capacity(
    address: str,
    shapes: Sequence[trace.TraceRequest],
    vocab: int,
    clients: int,
    window_s: float,
    seed: int,
    timeout: float,
    auth: ClientAuth | None = None,
) -> dict[str, Any]:
    """What the server sustains: a closed loop of `clients` for `window_s`; its output tokens per
    second over the last two thirds of the window (the first third fills the pipeline), over the
    mean output length of `shapes`. Counting tokens rather than whole requests: on a slow model a
    request can outlast much of the window."""
    results = asyncio.run(
        loadgen.closed_loop(address, shapes, clients, window_s, vocab, seed, timeout, auth)
    )
    steady = window_s / 3
    tokens = sum(1 for r in results for t in r.token_times_s if steady <= t <= window_s)
    tok_s = tokens / (window_s - steady)
    mean_out = statistics.fmean(r.output_len for r in shapes)
    done = [r for r in results if r.ok and r.sent_s + (r.e2e_s or 0.0) <= window_s]
    return {
        "rps": tok_s / mean_out,
        "method": f"closed loop, {clients} clients, {window_s:g} s: "
        f"{tok_s:.1f} tok/s / {mean_out:.0f} tokens a request",
        "output_tok_s": tok_s,
        "completed_in_window": len(done),
        "sent": len(results),
        "outcomes": dict(Counter(outcome(r) for r in results)),
        "ttft_s": slo.summary([r.ttft_s for r in done if r.ttft_s is not None]),
    }


def run(args: argparse.Namespace) -> int:
    policy = args.policy or "auto"
    if policy not in POLICIES:
        print(f"error: --overload takes one --policy of {list(POLICIES)}, got {policy!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    deployment = Deployment(args.model, args.prefill, args.decode, args.threads, args.kv_cache_gib,
                            args.threshold_tokens, args.threshold_queue, args.step_target_ms,
                            args.max_pending, gpus_per_worker=args.gpus_per_worker)  # fmt: skip
    logs = None if args.address else Path(tempfile.mkdtemp(prefix="pdserve-overload-"))
    server = None if logs is None else ServerProcess(deployment, policy, logs / f"{policy}.log")
    auth = ClientAuth.from_args(args)
    out: dict[str, Any] = {**session.provenance(),
                           "mode": "overload", "factor": args.overload, "policy": policy,
                           "deployment": None if args.address else asdict(deployment)}  # fmt: skip
    try:
        info = server.wait_ready() if server else session.server_info(args.address, auth)
        address = args.address or server.address  # type: ignore[union-attr]
        vocab = info.vocab_size
        # Lengths for the SLO calibration (their 99th-percentile prompt) and the closed loop.
        shapes = trace.synthetic(
            200, args.prompt_len, args.output_len, 1.0, args.seed, args.prefixes
        )
        objective = session.objective(args, address, shapes, vocab, out)
        warm = [trace.TraceRequest(0.0, 16, 4)]
        session.run_trace(address, warm, 1.0, vocab, args, "warm-up", seed=2_000_000 + args.seed)
        if args.capacity is not None:
            out["capacity"] = {"rps": args.capacity, "method": "given (--capacity)"}
        else:
            print(f"measuring capacity: {args.capacity_clients} clients, closed loop, "
                  f"{args.capacity_duration:g} s")  # fmt: skip
            # Prompts of its own (seed): the overload's would hit the prefix cache.
            out["capacity"] = capacity(address, shapes, vocab, args.capacity_clients,
                                       args.capacity_duration, 5_000_000 + args.seed,
                                       args.timeout, auth)  # fmt: skip
        rate = args.overload * out["capacity"]["rps"]
        reqs = arrivals(
            rate, args.duration, args.prompt_len, args.output_len, args.seed, args.prefixes
        )
        out.update(rate=rate, duration_s=args.duration, max_pending=args.max_pending)
        print(f"overload: {len(reqs)} requests at {rate:.2f}/s for {args.duration:g} s")
        hint = None if args.no_slo_hint else (objective.ttft_s, objective.itl_s)
        out["load_average_before"] = os.getloadavg()  # the machine's other work, for the record
        result = asyncio.run(
            overload(address, reqs, rate, vocab, args.seed, args.timeout, hint, auth,
                     Probe(server.pids) if server else None, args.sample_every)
        )  # fmt: skip
        out["load_average_after"] = os.getloadavg()
    finally:
        if server is not None:
            server.stop()
    out["slo"] = asdict(objective)
    out["figures"] = figures(result, objective)
    out["samples"] = [asdict(s) for s in result.samples]
    out["requests"] = [r.to_json() for r in result.results]
    print(report(out, rss_sampled=server is not None))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        from bench import plots

        folder = Path(args.plot)
        folder.mkdir(parents=True, exist_ok=True)
        plots.rss_over_time(result.samples, folder)
        print(f"plots in {folder}/")
    if logs is not None:
        print(f"server log in {logs}/")
    got = out["figures"]
    bad = got["lost"] + got["rejected_without_retry_after"] + got["failed"]
    return 0 if got["accounted"] and not bad else 1
