"""What every bench run does against a server: send a trace with a progress bar, ask the
server what it serves, fix the SLOs (given, or measured on lone requests first), and read how
busy each worker was over a run (from the server's metrics) and where the host's CPU went."""

from __future__ import annotations

import asyncio
import os
import platform
import shlex
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tqdm import tqdm

from bench import host_cpu, loadgen, slo, trace
from bench.errors import BenchError
from bench.server import ServerProcess
from pdserve_client import ClientAuth, metrics


def run_trace(
    address: str,
    reqs: list[trace.TraceRequest],
    rate: float,
    vocab: int,
    args: Any,
    desc: str,
    objective: slo.Slo | None = None,
    seed: int | None = None,
):
    bar = tqdm(total=len(reqs), desc=desc, unit="req", leave=False)
    hint = None
    if objective is not None and not args.no_slo_hint:
        hint = (objective.ttft_s, objective.itl_s)
    results = asyncio.run(
        loadgen.run(
            address,
            reqs,
            rate,
            vocab,
            args.seed if seed is None else seed,
            args.timeout,
            lambda _r: bar.update(),
            hint,
            ClientAuth.from_args(args),
        )
    )
    bar.close()
    # From the first send to the last answer: the wait before the trace's first arrival is not
    # part of the run.
    start = min((r.sent_s for r in results), default=0.0)
    end = max((r.sent_s + (r.e2e_s or 0.0) for r in results), default=0.0)
    return results, max(end - start, 1e-9)


def provenance() -> dict[str, Any]:
    """How a run was made, for its JSON: the command line, the commit of this checkout (None
    outside a git checkout) and whether tracked files differed from it, the host, and when. The
    fields of engine/provenance.py's, which the engine, transfer and router benches record:
    bench/ is a client of the server and imports none of those (DESIGN.md, layout)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=Path(__file__).parent, timeout=5,
                                  capture_output=True, text=True, check=True)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "command": shlex.join([_program(), *sys.argv[1:]]),
        "commit": commit,
        "changed": bool(changed) if changed is not None else None,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _program() -> str:
    """How the command was called: `pdserve`, also when run as `python -m router.cli`."""
    name = Path(sys.argv[0]).name
    return "pdserve" if name in ("cli.py", "__main__.py") else name


def cpu_reading(server: ServerProcess) -> host_cpu.Reading:
    """The host's CPU seconds so far (bench/host_cpu.py): those of `server`'s process tree, its
    router's and workers' by name, this process's and the host's."""
    try:
        pids = asyncio.run(server.pids())
    except (grpc.RpcError, OSError, RuntimeError) as exc:  # the tree, without the workers' names
        print(f"warning: the server's workers not listed by its admin service: {exc!r}")
        pids = {"router": server.proc.pid}
    return host_cpu.read(pids, server.proc.pid)


def calibrate(address: str, reqs: list[trace.TraceRequest], vocab: int, args: Any) -> dict:
    """Single requests alone: TTFT at the trace's 99th-percentile prompt (one TTFT SLO for the
    whole trace, so it must be one its long prompts can meet), and ITL."""
    lens = sorted(r.prompt_len for r in reqs)
    p99 = int(np.percentile(lens, 99, method="inverted_cdf"))  # nearest rank: a prompt's length
    probe = [trace.TraceRequest(0.0, p99, 32)]
    ttfts, itls = [], []
    for i in range(3):
        # A fresh prompt each time (its own seed): a repeat would hit the prefix cache.
        seed = 1_000_000 + args.seed * 10 + i
        res, _ = run_trace(address, probe, 1.0, vocab, args, f"calibrate {i + 1}/3", seed=seed)
        if res[0].ok:
            ttfts.append(res[0].ttft_s)
            itls.append(statistics.median(res[0].itl_s))
    if not ttfts:
        raise BenchError(
            f"calibration: a lone {p99}-token prompt (the trace's 99th percentile) failed 3 "
            f"times: {res[0].status}: {res[0].error or 'incomplete'} (or give --slo-ttft and "
            "--slo-itl)"
        )
    return {"prompt_len": p99, "ttft_s": statistics.median(ttfts), "itl_s": statistics.median(itls)}


def server_info(address: str, auth: ClientAuth):
    from pdserve_proto import generation_pb2 as pb
    from pdserve_proto import generation_pb2_grpc as pb_grpc

    try:
        with auth.channel(address) as channel:
            return pb_grpc.GenerationStub(channel).Info(
                pb.InfoRequest(), timeout=30, wait_for_ready=True, metadata=auth.metadata
            )
    except grpc.RpcError as exc:
        raise BenchError(f"--address {address}: {exc.code().name}: {exc.details()}") from None


def objective(args: Any, address: str, reqs, vocab: int, out: dict) -> slo.Slo:
    cal: dict = {}
    if args.slo_ttft is None or args.slo_itl is None:
        cal = calibrate(address, reqs, vocab, args)
        out["calibration"] = cal
    ttft = args.slo_ttft if args.slo_ttft is not None else args.slo_ttft_scale * cal["ttft_s"]
    itl = args.slo_itl if args.slo_itl is not None else args.slo_itl_scale * cal["itl_s"]
    out["slo"] = {"ttft_s": ttft, "itl_s": itl, "itl_metric": args.slo_itl_metric}
    parts = []
    if args.slo_ttft is None:
        parts.append(
            f"TTFT: {args.slo_ttft_scale:g} x {cal['ttft_s']:.3f} s of a lone "
            f"{cal['prompt_len']}-token prompt"
        )
    if args.slo_itl is None:
        parts.append(
            f"ITL: {args.slo_itl_scale:g} x {cal['itl_s'] * 1000:.1f} ms of a lone request"
        )
    how = "; ".join(parts) or "both given"
    print(f"SLO: TTFT <= {ttft:.3f} s, {args.slo_itl_metric} <= {itl * 1000:.1f} ms ({how})")
    return slo.Slo(ttft, itl, args.slo_itl_metric)


def busy_seconds(metrics_address: str | None) -> dict[str, float] | None:
    """Each worker's seconds spent running steps so far, from the server's metrics (None: no
    metrics endpoint, or it did not answer: the run is measured without)."""
    if metrics_address is None:
        return None
    try:
        samples = metrics.scrape(metrics_address)
    except (OSError, ValueError):
        return None
    return {w: v for (w,), v in metrics.by_labels(samples, metrics.BUSY_SECONDS, "worker").items()}


def busy_share(
    before: dict[str, float] | None, after: dict[str, float] | None, wall_s: float
) -> dict[str, float] | None:
    """The share of a run of `wall_s` seconds each worker spent running steps (workers seen
    at both ends only; metrics.shares)."""
    if before is None or after is None or wall_s <= 0:
        return None
    return metrics.shares(before, after, wall_s)
