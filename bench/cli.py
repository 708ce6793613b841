"""`pdserve bench`: the same trace through each policy, same seed, one run, one table.

Without --address, each policy gets its own `pdserve serve` (same model, same total workers and
threads; restarted between policies). With --address, the running server is measured as is.

Per policy: warm-up, the trace (open loop at --rate), optionally a goodput-vs-rate sweep. SLOs
come from --slo-ttft / --slo-itl, or else from single requests measured alone on the first
server (TTFT of the trace's 99th-percentile prompt x --slo-ttft-scale, ITL x --slo-itl-scale),
the same for every policy. With the disaggregated policy in the list, the trace's short
requests also run alone on its server: the decode-only baseline for ITL.

With --overload F, one policy instead gets open-loop load at F times what its server sustains,
and the run books how every request ended, its memory and its queues (bench/overload.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import host_cpu, loadgen, overload, predictions, report, session, slo, trace
from bench.errors import BenchError
from bench.options import add_arguments as add_arguments  # the bench's flags, for its parser
from bench.options import refused
from bench.server import POLICIES, Deployment, ServerProcess
from pdserve_client import ClientAuth
from pdserve_client.connect import ClientAuthError

SERVER = "server"  # the label of a run against --address without --policy


def _trace(args: argparse.Namespace) -> list[trace.TraceRequest]:
    if args.trace == "synthetic":
        if args.scale != 1.0:
            raise trace.TraceError("synthetic: --scale: set --prompt-len and --output-len")
        n = args.num_requests or 100
        return trace.synthetic(
            n, args.prompt_len, args.output_len, args.burstiness, args.seed, args.prefixes
        )
    return trace.load(args.trace, args.num_requests, args.scale, args.seed)


class Terminated(KeyboardInterrupt):
    """SIGTERM: it unwinds as Ctrl-C does, stopping the servers this bench started."""


def main(args: argparse.Namespace) -> int:
    """`run`, with bad input, a server that did not start and a lost server ending in one
    `error: ...` line (exit 2 for bad input, else 1), and SIGINT or SIGTERM stopping the servers
    the bench started before it exits (130, 143)."""

    def terminate(_signum: int, _frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return run(args)
    except trace.TraceError as exc:
        print(f"error: --trace: {exc}", file=sys.stderr)
        return 2
    except ClientAuthError as exc:  # --tls-* or --token-file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt as exc:
        print("\nstopped: the servers this bench started are stopped; the policy under way is "
              "not in --json", file=sys.stderr)  # fmt: skip
        return 143 if isinstance(exc, Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sweep(
    address: str, reqs, vocab: int, objective: slo.Slo, args: Any, policy: str, records: list
):
    """Probe offered rates with fresh prompts: `args.sweep_rates` where given (every one, in
    order), else a binary search of five probes between --rate / 4 and --rate x 4. Returns the
    highest rate probed at >= 90% attainment (0.0 where none) and every probe's figures; each
    probe's request records go to `records`, tagged with the policy and the probe's rate."""
    points: list[dict[str, float]] = []  # each probe: its rate, goodput and attainment

    def probe(rate: float) -> bool:
        # Fresh prompts for every probe: the main run's would hit the prefix cache.
        seed = 3_000_000 + args.seed * 100 + len(points)
        res, wall = session.run_trace(
            address, reqs, rate, vocab, args, f"{policy} sweep {rate:.2f}/s", objective, seed
        )
        fig = slo.figures(res, objective, wall)
        points.append(
            {"rate": rate, "goodput_rps": fig["goodput_rps"], "attainment": fig["attainment"]}
        )
        records.extend(dict(r.to_json(), policy=policy, probe_rate=rate) for r in res)
        return fig["attainment"] >= 0.9

    if args.sweep_rates:
        for rate in args.sweep_rates:
            probe(rate)
    else:
        lo, hi = args.rate / 4, args.rate * 4
        for _ in range(5):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    best = max((p["rate"] for p in points if p["attainment"] >= 0.9), default=0.0)
    return best, points


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in (args.policy or ",".join(POLICIES)).split(",") if p.strip()]
    problem = refused(args, policies)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.overload is not None:
        return overload.run(args)
    reqs = _trace(args)
    if args.address:
        # The running server, as it is: named after --policy where one is given (a label only:
        # nothing here sets its policy), else "server", which counts as no fixed policy.
        policies = policies[:1] if args.policy else [SERVER]
    deployment = Deployment(args.model, args.prefill, args.decode, args.threads, args.kv_cache_gib,
                            args.threshold_tokens, args.threshold_queue,
                            args.step_target_ms,
                            prefill_hold_ms=args.prefill_hold_ms,
                            gpus_per_worker=args.gpus_per_worker)  # fmt: skip
    # The logs of the servers this run starts (none with --address).
    logs = None if args.address else Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    out: dict[str, Any] = {**session.provenance(),
                           "trace": args.trace, "rate": args.rate, "num_requests": len(reqs),
                           "warmup": args.warmup,
                           "deployment": None if args.address else asdict(deployment),
                           "policies": {},
                           "requests": []}  # fmt: skip
    objective: slo.Slo | None = None
    runs: dict[str, list[loadgen.RequestResult]] = {}
    sweeps: dict[str, list[dict[str, float]]] = {}
    rounds = max(1, args.repeat)
    if rounds > 1:
        out["rounds"] = [{} for _ in range(rounds)]
    # Each round in another order, so that no policy always runs first (or last) on the machine.
    schedule = [
        (r, policies[(i + r) % len(policies)]) for r in range(rounds) for i in range(len(policies))
    ]
    for rnd, policy in schedule:
        server = None
        try:
            if logs is not None:
                log = logs / (f"{policy}.log" if rnd == 0 else f"{policy}-{rnd + 1}.log")
                server = ServerProcess(deployment, policy, log)
            info = (
                server.wait_ready()
                if server
                else session.server_info(args.address, ClientAuth.from_args(args))
            )
            address = args.address or server.address  # type: ignore[union-attr]
            vocab = info.vocab_size
            if objective is None:
                objective = session.objective(args, address, reqs, vocab, out)
            lone_gap_s = _warm_up(address, reqs, vocab, objective, args)
            label = policy if rounds == 1 else f"{policy} (round {rnd + 1}/{rounds})"
            metrics = server.metrics_address if server else args.metrics_address
            busy0 = session.busy_seconds(metrics)
            cpu0 = session.cpu_reading(server) if server else None
            results, wall = session.run_trace(
                address, reqs, args.rate, vocab, args, label, objective
            )
            fig = slo.figures(results, objective, wall)
            # Where the host's CPU went: for a server this bench started (its processes known).
            fig["host_cpu"] = (
                host_cpu.cores(cpu0, session.cpu_reading(server)) if server and cpu0 else None
            )
            fig["lone_gap_s"] = lone_gap_s
            fig["predictions"] = predictions.accuracy([r.to_json() for r in results], objective)
            fig["busy"] = session.busy_share(busy0, session.busy_seconds(metrics), wall)
            if args.metrics_address and not fig["busy"]:
                print(f"warning: --metrics-address {args.metrics_address}: no worker's busy "
                      f"seconds read there (not the server's metrics endpoint?)")  # fmt: skip
            if rounds > 1:
                out["rounds"][rnd][policy] = fig
            tag = {"policy": policy} if rounds == 1 else {"policy": policy, "round": rnd + 1}
            out["requests"] += [dict(r.to_json(), **tag) for r in results]
            if rnd > 0:  # the table and the plots show the first round; the spread and records, all
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1))
                continue
            runs[policy] = results
            if args.sweep_rate:
                fig["max_rate_at_90pct"], fig["sweep"] = _sweep(
                    address, reqs, vocab, objective, args, policy,
                    out.setdefault("probe_requests", []),
                )  # fmt: skip
                sweeps[policy] = fig["sweep"]
            out["policies"][policy] = fig
            if policy == "disaggregated" and not args.no_baseline:
                out["baseline"] = _baseline(address, reqs, vocab, args, objective)
            if args.json:  # after every policy: a later failure keeps what was measured
                Path(args.json).write_text(json.dumps(out, indent=1))
        finally:
            if server is not None:
                server.stop()
    report.table(out, runs, args)
    report.sweeps(out)
    if rounds > 1:
        report.rounds(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        from bench import plots

        folder = Path(args.plot)
        folder.mkdir(parents=True, exist_ok=True)
        plots.itl_over_time(runs, args.long_prompt, folder)
        plots.cdfs(runs, folder)
        if sweeps:
            plots.goodput_vs_rate(sweeps, folder)
        print(f"plots in {folder}/")
    if logs is not None:
        print(f"server logs in {logs}/")
    none = [p for p, f in out["policies"].items() if not f["completed"]]
    if none:
        raise BenchError(f"no request of {', '.join(none)} completed (why: above)")
    return 0


def _baseline(
    address: str, reqs: list[trace.TraceRequest], vocab: int, args: Any, objective: slo.Slo | None
) -> dict:
    """The trace's short requests alone, at their own arrival times, on the deployment now up:
    the ITL they see without the long prompts beside them."""
    short = [r for r in reqs if r.prompt_len < args.long_prompt]
    if not short:
        print(f"decode-only baseline skipped: no prompt shorter than {args.long_prompt} tokens")
        return {"policy": "disaggregated, short requests alone", "requests": 0,
                "skipped": f"no prompt shorter than --long-prompt {args.long_prompt}"}  # fmt: skip
    base, _ = session.run_trace(
        address,
        short,
        args.rate,
        vocab,
        args,
        "baseline (short alone)",
        objective,
        4_000_000 + args.seed,  # prompts of its own: the main run's are cached
    )
    return {"policy": "disaggregated, short requests alone",
            "itl_s": slo.summary([g for r in base if r.ok for g in r.itl_s]),
            "requests": len(short)}  # fmt: skip


def _warm_up(
    address: str, reqs: list[trace.TraceRequest], vocab: int, objective: slo.Slo, args: Any
) -> float | None:
    """The server's first load, not measured: a short request alone (16 prompt tokens, 32 out),
    then with --warmup N the trace's first N requests (their lengths and spacing, other prompts:
    no prefix hits in the run). Returns the lone request's median gap: how fast the host ran just
    before this policy's run (policies run one after another on a shared host, whose speed can
    move between them)."""
    seed = 2_000_000 + args.seed
    lone, _ = session.run_trace(address, [trace.TraceRequest(0.0, 16, 32)], 1.0, vocab, args,
                                "warm-up", seed=seed)  # fmt: skip
    if args.warmup:
        session.run_trace(address, reqs[: args.warmup], args.rate, vocab, args, "warm-up",
                          objective, seed=seed + 1)  # fmt: skip
    gaps = [g for r in lone if r.ok for g in r.itl_s]
    return statistics.median(gaps) if gaps else None
