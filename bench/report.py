"""What `pdserve bench` prints once its policies have run: the table (with each worker's busy
share, the host's CPU, the router's predictions against measured, and the attainment at the
run's average host speed), the rate sweeps, and each round's goodput and ratio."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench import host_cpu, predictions, slo

FIXED = ("colocated-nochunk", "colocated", "disaggregated", "threshold")


def table(out: dict, runs: dict, args: Any) -> None:
    """The first round's table, one row a policy, then the figures beside it; fills in
    `host_scaled` and the baseline's ratio in `out`."""
    pol = out["policies"]
    fixed = [pol[p]["goodput_rps"] for p in FIXED if p in pol]
    best_fixed = max(fixed) if fixed else None
    head = (f"{'policy':<18} {'done':>4} {'fail':>4} {'rej':>4} {'kvfb':>4} {'cache':>5} "
            f"{'TTFT p50':>8} {'p99':>6} {'ITL p50':>7} {'p99':>6} {'TPOT':>5} {'req/s':>6} "
            f"{'tok/s':>6} {'attain':>6} {'goodput':>7} {'vs best fixed':>13} "
            f"{'lone gap':>8}")  # fmt: skip
    print(
        f"trace {out['trace']}, {out['num_requests']} requests at {out['rate']:g}/s; ms unless said"
        "; kvfb: handoffs whose KV did not arrive (prefilled again where they decode); cache: the"
        " share of prompt tokens found in the prefix cache where they were prefilled; lone gap:"
        " a lone request's median gap just before the policy's run (the host's speed then)"
    )
    print(head)
    for p, f in pol.items():
        ratio = f"{f['goodput_rps'] / best_fixed:.2f}x" if best_fixed else "-"
        cells = [
            f"{p:<18}",
            f"{f['completed']:>4}",
            f"{f['failed']:>4}",
            f"{f['rejected']:>4}",
            f"{f.get('kv_fallbacks', 0):>4}",
            f"{f.get('cached_share', 0):>5.0%}",
            f"{_ms(f['ttft_s']['p50']):>8}",
            f"{_ms(f['ttft_s']['p99']):>6}",
            f"{_ms(f['itl_s']['p50']):>7}",
            f"{_ms(f['itl_s']['p99']):>6}",
            f"{_ms(f['tpot_s']['p50']):>5}",
            f"{f['throughput_rps']:>6.2f}",
            f"{f['output_tok_s']:>6.1f}",
            f"{f['attainment']:>6.0%}",
            f"{f['goodput_rps']:>7.3f}",
            f"{ratio:>13}",
            f"{_ms(f.get('lone_gap_s')):>8}",
        ]
        print(" ".join(cells))
    for p in pol:
        said = failures(runs.get(p, []))
        if said:
            print(f"{p}: not completed: {said}")
    busy = {p: f["busy"] for p, f in pol.items() if f.get("busy")}
    if busy:
        each = "; ".join(
            f"{p} " + ", ".join(f"{w} {v:.0%}" for w, v in sorted(b.items()))
            for p, b in busy.items()
        )
        print(f"busy (the share of the run each worker's engine spent executing steps): {each}")
    cpu = {p: f["host_cpu"] for p, f in pol.items() if f.get("host_cpu")}
    if cpu:
        print(f"host CPU over the run (cores; ray: the rest of the server's processes; bench: "
              f"this load generator): {host_cpu.line(cpu)}")  # fmt: skip
    predictions.report((p, f["predictions"]) for p, f in pol.items() if "predictions" in f)
    lone = {p: f.get("lone_gap_s") for p, f in pol.items()}
    scaled = {}
    if "slo" in out:
        runs_here = {p: runs[p] for p in pol if p in runs}
        scaled = slo.host_scaled(runs_here, lone, slo.Slo(**out["slo"]))
    if scaled:
        out["host_scaled"] = scaled
        print("attainment with each policy's SLOs scaled by its lone gap over the mean (the run's "
              "average host speed): " + ", ".join(f"{p} {v['attainment']:.0%} (x{v['factor']:.2f})"
                                                  for p, v in scaled.items()))  # fmt: skip
    base = out.get("baseline")
    if base and base.get("itl_s") and "disaggregated" in runs:
        short = [r for r in runs["disaggregated"] if r.ok and r.prompt_len < args.long_prompt]
        p99 = slo.summary([g for r in short for g in r.itl_s])["p99"]
        b99 = base["itl_s"]["p99"]
        if p99 and b99:
            out["baseline"]["disaggregated_short_itl_p99_s"] = p99
            out["baseline"]["ratio"] = p99 / b99
            print(f"short requests' ITL p99: disaggregated {p99 * 1000:.0f} ms vs alone "
                  f"{b99 * 1000:.0f} ms = {p99 / b99:.2f}x (target <= 1.3x)")  # fmt: skip


def sweeps(out: dict) -> None:
    """Each swept policy's attainment at every rate it probed, and its highest rate at >= 90%."""
    swept = {p: f for p, f in out["policies"].items() if "sweep" in f}
    if not swept:
        return
    rates = sorted({pt["rate"] for f in swept.values() for pt in f["sweep"]})
    print("attainment per offered rate (req/s); highest rate at >= 90% attainment")
    print(f"{'policy':<18} " + " ".join(f"{r:>6.2f}" for r in rates) + f" {'highest':>8}")
    for p, f in swept.items():
        at = {pt["rate"]: pt["attainment"] for pt in f["sweep"]}
        cells = [f"{at[r]:>6.0%}" if r in at else f"{'':>6}" for r in rates]
        print(f"{p:<18} " + " ".join(cells) + f" {f['max_rate_at_90pct']:>8.2f}")
    top = max(f["max_rate_at_90pct"] for f in swept.values())
    leaders = [p for p, f in swept.items() if f["max_rate_at_90pct"] == top] if top > 0 else []
    out["sweep_highest"] = {"rate": top, "policies": leaders}
    if leaders:
        print(f"highest: {', '.join(leaders)} at {top:.2f} req/s")
    else:
        print("highest: none; no policy attained 90% at any rate probed")


def rounds(out: dict) -> None:
    """Each policy's goodput over the rounds, and its ratio to the best fixed policy of the same
    round: the spread a single run hides."""
    print("goodput per round (req/s), and over the best fixed policy of the same round")
    out["spread"] = {}
    for policy in out["policies"]:
        goods, ratios, lone = [], [], []
        for rnd in out["rounds"]:
            if policy not in rnd:
                continue
            goods.append(rnd[policy]["goodput_rps"])
            lone.append(rnd[policy].get("lone_gap_s"))
            best = max((rnd[p]["goodput_rps"] for p in FIXED if p in rnd), default=0.0)
            if best > 0:
                ratios.append(rnd[policy]["goodput_rps"] / best)
        out["spread"][policy] = {"goodput_rps": goods, "vs_best_fixed": ratios,
                                 "lone_gap_s": lone}  # fmt: skip
        each = ", ".join(f"{g:.3f}" for g in goods)
        rs = ", ".join(f"{r:.2f}x" for r in ratios) or "-"
        med = f"median {statistics.median(ratios):.2f}x" if ratios else ""
        gaps = ", ".join(_ms(g) for g in lone)
        print(f"  {policy:<18} {each}   vs best fixed: {rs} {med}   lone gap ms: {gaps}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def failures(results: list, most: int = 3) -> str:
    """Why a run's requests did not complete, the commonest reasons first: "3 x INVALID_ARGUMENT:
    prompt_len: ..." ("" when all did)."""
    why = Counter(
        f"{r.status}: {r.error}" if r.error else (r.status if r.status != "OK" else "cut short")
        for r in results
        if not r.ok
    )
    top = why.most_common(most)
    parts = [f"{n} x {text}" for text, n in top]
    if len(why) > most:
        parts.append(f"{why.total() - sum(n for _, n in top)} more")
    return "; ".join(parts)
