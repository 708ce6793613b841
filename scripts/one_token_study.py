"""The requests of one token (max_tokens 1: scores) against the others in `pdserve bench` JSON
files, per policy: where the one-token requests ran, their TTFT, and the others' TTFT and gaps.

    .venv/bin/python scripts/one_token_study.py benchmarks/one-token/bench-*.json

Prints one table; each row is one policy of one file (its goodput and attainment as the bench
computed them).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np


def _ms(xs: list[float], q: float) -> str:
    return f"{np.percentile(xs, q) * 1000:6.0f}" if xs else "     -"


def rows(path: Path) -> list[str]:
    run = json.loads(path.read_text())
    out = []
    for policy, summary in run["policies"].items():
        reqs = [r for r in run["requests"] if r.get("policy", policy) == policy]
        if "policy" not in run["requests"][0]:  # the requests of each policy in order
            n = len(run["requests"]) // len(run["policies"])
            i = list(run["policies"]).index(policy)
            reqs = run["requests"][i * n : (i + 1) * n]
        ok = [r for r in reqs if r["status"] == "OK"]
        one = [r for r in ok if r["output_len"] == 1]
        gen = [r for r in ok if r["output_len"] > 1]
        sent_one = sum(r["output_len"] == 1 for r in reqs)
        where = Counter(
            "handoff" if r["prefill_worker"] else r["decode_worker"] for r in one
        ).most_common()
        gaps = [g for r in gen for g in r["itl_s"]]
        out.append(
            f"{path.name:42s} {policy:13s} {summary['goodput_rps']:7.3f} "
            f"{summary['attainment'] * 100:5.0f}% | {len(one):3d}/{sent_one:<3d} "
            f"{_ms([r['ttft_s'] for r in one], 50)} {_ms([r['ttft_s'] for r in one], 90)} "
            f"{' '.join(f'{w} {k}' for w, k in where):32s} | {len(gen):3d} "
            f"{_ms([r['ttft_s'] for r in gen], 50)} {_ms(gaps, 99)}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    print(
        f"{'file':42s} {'policy':13s} goodput attain | one-token: done TTFT p50 p90 (ms), "
        "where they ran | others: done TTFT p50 (ms), gap p99 (ms)"
    )
    for f in args.files:
        for line in rows(f):
            print(line)


if __name__ == "__main__":
    main()
