"""What an overload run (bench/overload.py) records and how it adds up: its samples and its
requests, how each request ended (exactly one of OUTCOMES), the run's figures, and the report
printed from them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import slo
from bench.loadgen import RequestResult

LOST = "LOST"  # no answer at all, past its deadline and a grace period
OUTCOMES = ("completed", "rejected", "rejected_without_retry_after", "failed", "lost")


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float  # since the overload began
    rss: dict[str, int]  # process name (router, worker id) -> resident bytes
    awaiting_first_token: int  # sent, neither refused nor a first token yet (client view)
    in_flight: int  # sent, not yet ended (client view)
    router_pending: int | None  # the router's own count, where the probe can read it


@dataclass(slots=True)
class Overload:
    results: list[RequestResult]  # every request sent, in sending order
    samples: list[Sample] = field(default_factory=list)
    planned: int = 0  # arrivals in the schedule (all are sent unless the run was cut short)


def outcome(r: RequestResult) -> str:
    """How one request ended: one of OUTCOMES."""
    if r.ok:
        return "completed"
    if r.status == "RESOURCE_EXHAUSTED":
        return "rejected" if r.retry_after_ms is not None else "rejected_without_retry_after"
    if r.status in ("DEADLINE_EXCEEDED", LOST):
        return "lost"
    return "failed"  # with a status, or OK with fewer tokens than asked


def figures(run: Overload, objective: slo.Slo) -> dict[str, Any]:
    results = run.results
    books = Counter(outcome(r) for r in results)
    counts = {k: books.get(k, 0) for k in OUTCOMES}
    accepted = [r for r in results if r.status != "RESOURCE_EXHAUSTED"]
    ttfts = [r.ttft_s for r in accepted if r.ttft_s is not None]
    within = sum(1 for t in ttfts if t <= objective.ttft_s)
    attained = sum(1 for r in accepted if slo.attains(r, objective))
    sent_at = [r.sent_s for r in results]
    wall = max((r.sent_s + (r.e2e_s or 0.0) for r in results), default=0.0) - min(sent_at or [0])
    return {
        "planned": run.planned,
        "sent": len(results),
        **counts,
        "accounted": sum(counts.values()) == len(results),
        "failed_by_status": dict(
            Counter(r.status for r in results if outcome(r) == "failed" and r.status != "OK")
        ),
        "short": sum(1 for r in results if r.status == "OK" and not r.ok),
        "rejected_share": counts["rejected"] / len(results) if results else 0.0,
        "rejected_by_reason": dict(
            Counter(r.reject_reason or "?" for r in results if r.status == "RESOURCE_EXHAUSTED")
        ),
        "retry_after_ms": slo.summary([r.retry_after_ms for r in results if r.retry_after_ms]),
        "accepted": len(accepted),
        "accepted_ttft_s": slo.summary(ttfts),
        "accepted_within_ttft_slo": within / len(accepted) if accepted else None,
        "accepted_attainment": attained / len(accepted) if accepted else None,
        "goodput_rps": attained / wall if wall > 0 else 0.0,
        "completed_rps": counts["completed"] / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "processes": rss_figures(run.samples),
        "max_awaiting_first_token": max((s.awaiting_first_token for s in run.samples), default=0),
        "max_in_flight": max((s.in_flight for s in run.samples), default=0),
        "max_router_pending": max(
            (s.router_pending for s in run.samples if s.router_pending is not None), default=None
        ),
    }


def rss_figures(samples: Sequence[Sample]) -> dict[str, dict[str, int]]:
    """Per process: RSS at the first and last sample that saw it, and the largest."""
    seen: dict[str, list[int]] = {}
    for s in samples:
        for name, rss in s.rss.items():
            seen.setdefault(name, []).append(rss)
    return {
        name: {"start": v[0], "end": v[-1], "max": max(v), "samples": len(v)}
        for name, v in seen.items()
    }


def _mib(v: int) -> str:
    return f"{v / 2**20:,.0f}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _ms(v: float | None) -> str:
    return _num(None if v is None else v * 1000)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def report(out: dict[str, Any], rss_sampled: bool = True) -> str:
    f = out["figures"]
    cap, s = out["capacity"], out["slo"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(f["rejected_by_reason"].items()))
    lines = [
        f"overload {out['factor']:g}x: capacity {cap['rps']:.2f} req/s ({cap['method']}), "
        f"offered {out['rate']:.2f} req/s Poisson for {out['duration_s']:g} s; "
        f"TTFT SLO {_ms(s['ttft_s'])} ms",
        f"{'sent':>28} {f['sent']} (of {f['planned']} planned)",
        f"{'completed':>28} {f['completed']}",
        f"{'rejected (retry-after-ms)':>28} {f['rejected']} ({f['rejected_share']:.0%}; {reasons})",
        f"{'rejected without the hint':>28} {f['rejected_without_retry_after']}",
        f"{'failed with a status':>28} {f['failed']} {f['failed_by_status'] or ''}",
        f"{'lost':>28} {f['lost']}",
        f"{'every request accounted for':>28} {'yes' if f['accounted'] else 'NO'}",
        f"{'retry-after-ms p50 / p99':>28} {_num(f['retry_after_ms']['p50'])} / "
        f"{_num(f['retry_after_ms']['p99'])}",
        f"{'accepted TTFT p50 / p99':>28} {_ms(f['accepted_ttft_s']['p50'])} / "
        f"{_ms(f['accepted_ttft_s']['p99'])} ms (SLO {_ms(s['ttft_s'])} ms)",
        f"{'accepted within TTFT SLO':>28} {_pct(f['accepted_within_ttft_slo'])} "
        f"(attainment, TTFT and ITL: {_pct(f['accepted_attainment'])})",
        f"{'completed / goodput':>28} {f['completed_rps']:.2f} / {f['goodput_rps']:.2f} req/s",
        f"{'max waiting for 1st token':>28} {f['max_awaiting_first_token']} (client view; "
        f"router's own: {f['max_router_pending'] if f['max_router_pending'] is not None else '-'}"
        f"; --max-pending {out.get('max_pending') or 'default'})",
        f"{'max in flight':>28} {f['max_in_flight']}",
    ]
    if "load_average_before" in out:
        before, after = out["load_average_before"][0], out["load_average_after"][0]
        lines.append(f"{'machine load average (1 min)':>28} {before:.1f} before, {after:.1f} after")
    if not rss_sampled or not f["processes"]:
        lines.append("RSS: not sampled (a server this bench did not start)")
        return "\n".join(lines)
    lines.append(f"{'process':<12} {'RSS MiB start':>13} {'end':>6} {'max':>6} {'samples':>7}")
    for name, p in sorted(f["processes"].items()):
        lines.append(
            f"{name:<12} {_mib(p['start']):>13} {_mib(p['end']):>6} {_mib(p['max']):>6} "
            f"{p['samples']:>7}"
        )
    return "\n".join(lines)
