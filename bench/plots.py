"""The study's pictures (matplotlib, no screen needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.loadgen import RequestResult  # noqa: E402
from bench.overload_books import Sample  # noqa: E402


def itl_over_time(runs: dict[str, list[RequestResult]], long_from: int, out: Path) -> Path:
    """Every inter-token gap at the time it ended, per policy; long-prompt arrivals as lines."""
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(10, 2.4 * len(runs)), sharex=True, squeeze=False
    )
    for ax, (policy, results) in zip(axes[:, 0], runs.items()):
        t = [b for r in results for b in r.token_times_s[1:]]
        g = [x for r in results for x in r.itl_s]
        ax.scatter(t, np.asarray(g) * 1000, s=2, alpha=0.5)
        for r in results:
            if r.prompt_len >= long_from:
                ax.axvline(r.sent_s, color="red", alpha=0.3, linewidth=0.8)
        ax.set_ylabel("ITL ms")
        ax.set_yscale("log")
        ax.set_title(f"{policy} (red: long-prompt arrivals)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the start")
    return _save(fig, out / "itl_over_time.png")


def cdfs(runs: dict[str, list[RequestResult]], out: Path) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, results in runs.items():
        for ax, vals in (
            (a, [r.ttft_s for r in results if r.ttft_s is not None]),
            (b, [x for r in results for x in r.itl_s]),
        ):
            if vals:
                v = np.sort(vals)
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=policy)
    a.set_xlabel("TTFT s")
    b.set_xlabel("ITL s")
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    return _save(fig, out / "cdf.png")


def goodput_vs_rate(sweeps: dict[str, list[dict[str, float]]], out: Path) -> Path:
    """Each swept policy's goodput and attainment at every offered rate it probed."""
    fig, (a, b) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for policy, points in sweeps.items():
        pts = sorted(points, key=lambda p: p["rate"])
        rates = [p["rate"] for p in pts]
        a.plot(rates, [p["goodput_rps"] for p in pts], marker="o", label=policy)
        b.plot(rates, [100 * p["attainment"] for p in pts], marker="o", label=policy)
    a.set_ylabel("goodput, requests/s meeting the SLO")
    b.axhline(90, color="grey", linestyle="--", linewidth=1)
    b.set_ylabel("attainment, %")
    b.set_xlabel("offered rate, requests/s")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    return _save(fig, out / "goodput_vs_rate.png")


def rss_over_time(samples: Sequence[Sample], out: Path) -> Path:
    """The overload run: each process's RSS, and the requests waiting for a first token."""
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    names = sorted({n for s in samples for n in s.rss})
    for name in names:
        pts = [(s.t_s, s.rss[name] / 2**20) for s in samples if name in s.rss]
        a.plot([t for t, _ in pts], [m for _, m in pts], marker=".", label=name)
    a.set_ylabel("RSS MiB")
    a.legend(fontsize=8)
    t = [s.t_s for s in samples]
    b.plot(t, [s.awaiting_first_token for s in samples], label="waiting for a first token")
    b.plot(t, [s.in_flight for s in samples], label="in flight")
    if any(s.router_pending is not None for s in samples):
        b.plot(t, [s.router_pending or 0 for s in samples], label="router's queue")
    b.set_ylabel("requests")
    b.set_xlabel("seconds since the overload began")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    return _save(fig, out / "rss_over_time.png")


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
