"""SLO attainment and goodput (DistServe's definitions) and latency summaries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.loadgen import RequestResult


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    itl_s: float
    itl_metric: str = "itl_p99"  # or "tpot": what a request's decode speed is judged by


def summary(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean())}


def tpot(r: RequestResult) -> float | None:
    if r.ttft_s is None or r.e2e_s is None or r.tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.tokens - 1)


def attains(r: RequestResult, slo: Slo) -> bool:
    """Both its TTFT and its decode speed (ITL p99 within the request, or TPOT) meet the SLO."""
    if not r.ok or r.ttft_s is None or r.ttft_s > slo.ttft_s:
        return False
    if slo.itl_metric == "tpot":
        t = tpot(r)
        return t is None or t <= slo.itl_s
    gaps = r.itl_s
    return not gaps or float(np.percentile(gaps, 99)) <= slo.itl_s


def host_scaled(
    runs: dict[str, Sequence[RequestResult]], lone_gap_s: dict[str, float | None], slo: Slo
) -> dict[str, dict[str, float]]:
    """Each policy's attainment with both SLOs scaled by its lone request's gap over the mean of
    every policy's: how it would have fared at the run's average host speed, for a host whose
    speed moves between policies run one after another. Empty unless every policy has a gap."""
    gaps = {p: g for p in runs if (g := lone_gap_s.get(p)) is not None and g > 0}
    if len(gaps) < 2 or len(gaps) < len(runs):
        return {}
    mean = sum(gaps.values()) / len(gaps)
    out = {}
    for p, results in runs.items():
        k = gaps[p] / mean
        scaled = Slo(slo.ttft_s * k, slo.itl_s * k, slo.itl_metric)
        hit = sum(1 for r in results if attains(r, scaled))
        out[p] = {"factor": k, "attainment": hit / len(results) if results else 0.0}
    return out


def figures(results: Sequence[RequestResult], slo: Slo, wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    rejected = sum(1 for r in results if r.status == "RESOURCE_EXHAUSTED")
    attained = sum(1 for r in results if attains(r, slo))
    return {
        "ttft_s": summary([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": summary([g for r in ok for g in r.itl_s]),
        "tpot_s": summary([t for r in ok if (t := tpot(r)) is not None]),
        "e2e_s": summary([r.e2e_s for r in ok if r.e2e_s is not None]),
        "throughput_rps": len(ok) / wall_s,
        "output_tok_s": sum(r.tokens for r in ok) / wall_s,
        "attainment": attained / len(results) if results else 0.0,
        "goodput_rps": attained / wall_s,
        "completed": len(ok),
        "failed": len(results) - len(ok) - rejected,
        "rejected": rejected,
        # completed handed-off requests whose KV did not arrive and were prefilled again where they
        # decode (a request that fails after its fallback counts as failed, not here)
        "kv_fallbacks": sum(1 for r in ok if r.kv_fallback),
        # the completed requests' prompt tokens found in the prefix cache where they were prefilled
        "cached_share": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_len for r in ok)),
        "wall_s": wall_s,
    }
