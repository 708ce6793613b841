"""The router's predictions against what each request saw: for every request served, the TTFT and
the p99 inter-token gap the client measured over those the router predicted for the placement it
took (its FinalInfo), and the SLO misses predicted and not, per kind of placement.

`pdserve bench` prints this for every policy's run and keeps it in its JSON (`predictions`);
`python -m bench.predictions RUN.json` prints it for every policy and round of a saved run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from bench.slo import Slo, summary

PATHS = {"colocated": "colocated", "disaggregated": "handoff"}  # a request's path: its kind
KINDS = tuple(PATHS.values())


def kind(request: dict) -> str | None:
    """`colocated` (prefilled where it decodes), `handoff` (its KV sent from another worker), or
    None where the path is not known."""
    return PATHS.get(request.get("path", ""))


def _misses(pairs: Sequence[tuple[float, float]], limit: float) -> dict[str, int]:
    """Of (predicted, measured) pairs: misses foreseen (both past `limit`), missed unforeseen,
    and foreseen that met it after all. Foreseen: the prediction itself past the limit (the
    router weighs a miss chance around it, router/spread.py)."""
    return {
        "foreseen": sum(1 for p, m in pairs if p > limit and m > limit),
        "unforeseen": sum(1 for p, m in pairs if p <= limit < m),
        "false_alarms": sum(1 for p, m in pairs if p > limit >= m),
    }


def _judge(requests: Sequence[dict], objective: Slo) -> dict:
    ttft = [(r["predicted_ttft_s"], r["ttft_s"]) for r in requests]
    gap = [
        (r["predicted_itl_p99_s"], float(np.percentile(r["itl_s"], 99)))
        for r in requests
        if r["itl_s"]
    ]
    return {
        "requests": len(requests),
        "with_gaps": len(gap),  # those of more than one token: the gap's figures count these
        # handoffs whose KV never came, prefilled again where they decode: their TTFT includes
        # the prefill done again, which their prediction does not
        "kv_fallbacks": sum(1 for r in requests if r.get("kv_fallback")),
        "ttft_ratio": summary([m / p for p, m in ttft if p > 0]),
        "itl_p99_ratio": summary([m / p for p, m in gap if p > 0]),
        "ttft_misses": _misses(ttft, objective.ttft_s),
        # Only where the SLO judges a request's p99 gap, the figure predicted (not its TPOT).
        "itl_misses": _misses(gap, objective.itl_s) if objective.itl_metric == "itl_p99" else None,
    }


def accuracy(requests: Iterable[dict], objective: Slo) -> dict[str, dict]:
    """Per kind of placement (and `all`): how many requests were served with a prediction, the
    measured over the predicted TTFT and p99 gap (p50, p90, ...), and each SLO's misses
    predicted past it, not predicted past it, and predicted past it that met it. `requests` as
    `RequestResult.to_json` gives them; those that failed, were refused, ended short of their
    tokens, had no first token or were told no prediction are left out. ITL misses only where
    the SLO judges the p99 gap (`itl_p99`)."""
    served = [
        r
        for r in requests
        if r.get("status") == "OK"
        and r.get("tokens") == r.get("output_len")
        and r.get("ttft_s") is not None
        and r.get("predicted_ttft_s") is not None
        and r.get("predicted_itl_p99_s") is not None
    ]
    out = {"all": _judge(served, objective)}  # every kind, an unknown path's too
    for k in KINDS:
        of_kind = [r for r in served if kind(r) == k]
        if of_kind:
            out[k] = _judge(of_kind, objective)
    return out


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _misses_cell(m: dict[str, int] | None) -> str:
    return "-" if m is None else f"{m['foreseen']}/{m['unforeseen']}/{m['false_alarms']}"


def report(rows: Iterable[tuple[str, dict[str, dict]]]) -> None:
    """Print one line per (label, kind of placement) of `accuracy` figures."""
    rows = list(rows)
    if not rows:
        print("predictions against measured: no run to judge")
        return
    print("predictions against measured, per request served: measured over predicted (p50, p90);"
          " SLO misses predicted past the SLO/not/predicted past it but met")  # fmt: skip
    print(f"{'policy':<28} {'placed':<10} {'n':>4} {'TTFT p50':>8} {'p90':>5} {'gap p99 p50':>11}"
          f" {'p90':>5} {'TTFT misses':>11} {'ITL misses':>10}")  # fmt: skip
    for label, acc in rows:
        if not acc["all"]["requests"]:
            print(f"{label:<28} no request served with a prediction (none recorded in this run?)")
            continue
        for k in ("all", *KINDS):
            if k not in acc:
                continue
            f = acc[k]
            print(f"{label:<28} {k:<10} {f['requests']:>4} {_x(f['ttft_ratio']['p50']):>8} "
                  f"{_x(f['ttft_ratio']['p90']):>5} {_x(f['itl_p99_ratio']['p50']):>11} "
                  f"{_x(f['itl_p99_ratio']['p90']):>5} {_misses_cell(f['ttft_misses']):>11} "
                  f"{_misses_cell(f['itl_misses']):>10}")  # fmt: skip


def of_saved_run(doc: dict) -> list[tuple[str, dict[str, dict]]]:
    """`accuracy` for every policy and round of a saved `pdserve bench --json` document."""
    if "slo" not in doc:
        raise ValueError("the run has no SLOs (`slo`): nothing to judge misses by")
    objective = Slo(**doc["slo"])
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in doc.get("requests", []):  # an --overload run names its one policy at the top
        key = (r.get("policy", doc.get("policy", "?")), r.get("round", 1))
        groups.setdefault(key, []).append(r)
    n = max((rnd for _, rnd in groups), default=1)
    return [
        (f"{policy} (round {rnd}/{n})" if n > 1 else policy, accuracy(reqs, objective))
        for (policy, rnd), reqs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.predictions",
        description="The router's predictions against what each request saw, from the JSON of "
        "a `pdserve bench --json` run: per policy, round and kind of placement.",
    )
    p.add_argument("run", type=Path, help="a `pdserve bench --json` file")
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.run.read_text())
        rows = of_saved_run(doc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: run: {args.run}: {exc!r}")
        return 2
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
