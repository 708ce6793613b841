"""`pdserve status`: a terminal summary of a running server, read from its metrics endpoint
(the same figures Prometheus scrapes): pools and workers, KV usage, queues, how busy each worker
was (the share of the interval it ran steps), request and token rates, latency quantiles by path,
the router's choices, transfers and refusals.

Rates come from two scrapes `--interval` seconds apart; quantiles are over everything since the
server started, interpolated within histogram buckets as Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import argparse
import http.client
import math
import sys
import time
import urllib.error
from collections import defaultdict
from collections.abc import Iterable

from pdserve_client.argtypes import address, seconds
from pdserve_client.metrics import BUSY_SECONDS, Samples, by_labels, scrape, shares


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        type=address(9400),
        default="127.0.0.1:9400",
        help="the server's metrics host:port (host alone: port 9400)",
    )
    p.add_argument(
        "--interval", type=seconds, default=1.0, help="seconds between two scrapes (> 0)"
    )


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """histogram_quantile over cumulative (upper bound, count) pairs."""
    bs = sorted(buckets)
    if not bs or bs[-1][1] <= 0:
        return None
    rank = q * bs[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in bs:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_le, prev_c = le, c
    return prev_le


def _quantiles(samples: Samples, metric: str) -> dict[str, tuple[float | None, float | None]]:
    """p50 and p99 by path, over the path's series summed (sum by (le, path), as Prometheus)."""
    buckets = by_labels(samples, metric + "_bucket", "path", "le")
    per_path: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (path, le), v in buckets.items():
        per_path[path].append((float(le), v))
    return {p: (quantile(0.5, b), quantile(0.99, b)) for p, b in sorted(per_path.items())}


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _fmt_rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def render(before: Samples, after: Samples, seconds: float, address: str) -> str:
    lines = [f"pdserve metrics at {address}"]
    roles = by_labels(after, "pdserve_workers", "role")
    lines.append(
        "workers: " + (", ".join(f"{int(v)} {r[0]}" for r, v in sorted(roles.items())) or "none")
    )
    lines.append(
        f"{'worker':<12} {'role':<8} {'running':>7} {'waiting':>7} {'KV used':>8} "
        f"{'queued prefill tok':>18} {'prefix hits':>11} {'preempted':>9} "
        f"{'prefills for peers':>18} {'local':>6} {'decoding':>8} {'busy':>5}"
    )
    running = by_labels(after, "pdserve_worker_requests_running", "worker", "role")
    waiting = by_labels(after, "pdserve_worker_requests_waiting", "worker", "role")
    kv = by_labels(after, "pdserve_worker_kv_cache_usage_ratio", "worker", "role")
    queued = by_labels(after, "pdserve_worker_queued_prefill_tokens", "worker", "role")
    hits = by_labels(after, "pdserve_worker_prefix_cache_hits_tokens_total", "worker", "role")
    queries = by_labels(after, "pdserve_worker_prefix_cache_queries_tokens_total", "worker", "role")
    preempt = by_labels(after, "pdserve_worker_preemptions_total", "worker", "role")
    prefills = by_labels(after, "pdserve_worker_prefills_total", "worker", "role", "kind")
    decoding = by_labels(after, "pdserve_worker_decodes_running", "worker", "role")
    # The share of the interval each engine ran steps (none for a worker new since the first
    # scrape, or where the router started afresh between them).
    busy = shares(
        by_labels(before, BUSY_SECONDS, "worker", "role"),
        by_labels(after, BUSY_SECONDS, "worker", "role"),
        seconds,
    )
    for key in sorted(running, key=lambda k: (k[1], k[0])):
        hit = hits.get(key, 0) / queries[key] if queries.get(key) else 0.0
        busy_cell = f"{busy[key]:>5.0%}" if key in busy else f"{'-':>5}"
        lines.append(
            f"{key[0]:<12} {key[1]:<8} {running[key]:>7.0f} {waiting.get(key, 0):>7.0f} "
            f"{kv.get(key, 0):>8.1%} {queued.get(key, 0):>18.0f} {hit:>11.1%} "
            f"{preempt.get(key, 0):>9.0f} {prefills.get((*key, 'for_peer'), 0):>18.0f} "
            f"{prefills.get((*key, 'local'), 0):>6.0f} {decoding.get(key, 0):>8.0f} {busy_cell}"
        )
    waits = by_labels(after, "pdserve_worker_prompt_wait_steps_total", "worker", "role")
    if any(waits.values()):
        lines.append(
            "steps run with prompts waiting for short decodes: "
            + ", ".join(f"{k[0]} {v:.0f}" for k, v in sorted(waits.items()) if v)
        )
    node_shares = by_labels(after, "pdserve_node_step_share", "node", "peer")
    if node_shares:
        lines.append(
            "steps beside a busy peer on the node (measured, else a prior): "
            + ", ".join(f"{k[0]} {v:.2f}x ({k[1]})" for k, v in sorted(node_shares.items()))
        )
    spreads = by_labels(after, "pdserve_prediction_spread", "kind", "worker")
    if spreads:
        lines.append(
            "how far predictions err (sd of ln(measured / predicted)): "
            + ", ".join(
                f"{k[0]}{' ' + k[1] if k[1] else ''} {v:.2f}" for k, v in sorted(spreads.items())
            )
        )
    biases = by_labels(after, "pdserve_prediction_bias_ratio", "kind", "worker")
    if biases:
        lines.append(
            "measured p99 gap over predicted: "
            + ", ".join(f"{k[1]} {k[0]} {v:.2f}" for k, v in sorted(biases.items()))
        )
    factors = by_labels(after, "pdserve_worker_gap_over_step_ratio", "worker")
    if factors:
        lines.append(
            "gaps at the router over steps: "
            + ", ".join(f"{k[0]} {v:.2f}x" for k, v in sorted(factors.items()))
        )
    reqs = by_labels(after, "pdserve_requests_total", "path")
    reqs0 = by_labels(before, "pdserve_requests_total", "path")
    toks = sum(by_labels(after, "pdserve_generation_tokens_total").values())
    toks0 = sum(by_labels(before, "pdserve_generation_tokens_total").values())
    total = sum(reqs.values())
    rate = (total - sum(reqs0.values())) / seconds
    per_path = ", ".join(f"{p[0]} {v:.0f}" for p, v in sorted(reqs.items()))
    pending = sum(by_labels(after, "pdserve_requests_pending").values())
    active = sum(by_labels(after, "pdserve_requests_active").values())
    lines.append(
        f"requests: {total:.0f} ({per_path or 'none'}); now {rate:.1f} req/s, "
        f"{(toks - toks0) / seconds:.0f} output tok/s; {active:.0f} active, {pending:.0f} of "
        "them before their first token"
    )
    fin = by_labels(after, "pdserve_requests_total", "finish_reason")
    said = ", ".join(f"{k[0]} {v:.0f}" for k, v in sorted(fin.items())) or "-"
    cut = by_labels(after, "pdserve_requests_cut_short_total", "reason")
    if any(cut.values()):  # of the length finishes, those a worker's limit cut short
        said += (
            " (of them cut short: "
            + ", ".join(f"{k[0]} {v:.0f}" for k, v in sorted(cut.items()) if v)
            + ")"
        )
    lines.append("finish: " + said)
    for label, metric in (
        ("TTFT", "pdserve_time_to_first_token_seconds"),
        ("ITL", "pdserve_inter_token_latency_seconds"),
    ):
        qs = _quantiles(after, metric)
        text = "; ".join(f"{p} {_fmt_s(a)} / {_fmt_s(b)}" for p, (a, b) in qs.items())
        lines.append(f"{label} p50 / p99 since start: {text or '-'}")
    dec = by_labels(after, "pdserve_path_decisions_total", "path", "reason")
    lines.append(
        "decisions: " + (", ".join(f"{p}/{r} {v:.0f}" for (p, r), v in sorted(dec.items())) or "-")
    )
    rej = by_labels(after, "pdserve_admission_rejections_total", "reason")
    lines.append(
        "rejected: " + (", ".join(f"{k[0]} {v:.0f}" for k, v in sorted(rej.items())) or "none")
    )
    ok = sum(by_labels(after, "pdserve_kv_transfers_total").values())
    nbytes = sum(by_labels(after, "pdserve_kv_transfer_bytes_total").values())
    fails = by_labels(after, "pdserve_kv_transfer_failures_total", "reason")
    bw = sum(by_labels(after, "pdserve_kv_transfer_bandwidth_bytes_per_second").values())
    lines.append(
        f"KV transfers: {ok:.0f} done, {nbytes / 1e6:.1f} MB, "
        f"{sum(fails.values()):.0f} failed, latest {_fmt_rate(bw)}"
    )
    resumed = sum(by_labels(after, "pdserve_requests_resumed_total").values())
    lines.append(f"resumed on another worker (theirs lost): {resumed:.0f}")
    falls = by_labels(after, "pdserve_local_prefill_fallbacks_total", "reason")
    lines.append(
        "prefilled on the decode worker after all: "
        + (", ".join(f"{k[0]} {v:.0f}" for k, v in sorted(falls.items()) if v) or "none")
    )
    deaths = by_labels(after, "pdserve_worker_failures_total", "worker")
    hangs = by_labels(after, "pdserve_worker_hangs_total", "worker")
    lost = [
        f"{k[0]} {v:.0f}" + (f" (hung {hangs[k]:.0f})" if hangs.get(k) else "")
        for k, v in sorted(deaths.items())
        if v
    ]
    lines.append("workers lost (died or hung): " + (", ".join(lost) or "none"))
    restarts = by_labels(after, "pdserve_worker_restarts_total", "role")
    lines.append(
        "dead workers replaced: "
        + (", ".join(f"{k[0]} {v:.0f}" for k, v in sorted(restarts.items()) if v) or "none")
    )
    err = _quantiles(after, "pdserve_ttft_prediction_error_ratio")
    lines.append(
        "TTFT prediction error, median: "
        + ("; ".join(f"{p} {a:.0%}" for p, (a, _) in err.items() if a is not None) or "-")
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        before = scrape(args.address)
        time.sleep(args.interval)
        after = scrape(args.address)
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        # Not an HTTP server (a gRPC port answers HTTP/2 frames), or not Prometheus text.
        bad = isinstance(exc, http.client.BadStatusLine)
        if bad and not isinstance(exc, http.client.RemoteDisconnected):  # binary first bytes
            why = "it does not answer HTTP: a gRPC port?"
        else:
            why = f"{type(exc).__name__}: {exc}"[:200]
        print(
            f"error: no pdserve metrics at {args.address}? ({why}; `pdserve serve` prints the "
            "metrics port: --metrics-port, 9400)",
            file=sys.stderr,
        )
        return 1
    print(render(before, after, args.interval, args.address))
    return 0
