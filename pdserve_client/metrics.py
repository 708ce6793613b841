"""Reading a pdserve server's Prometheus metrics as a client: its /metrics text parsed into
samples, and samples summed by label. `pdserve status` reads the figures it prints this way, and
`pdserve bench` how busy each worker was over a run."""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

K = TypeVar("K")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Seconds a worker's engine spent executing steps (counter, per worker and role).
BUSY_SECONDS = "pdserve_worker_busy_seconds_total"


def parse(text: str) -> Samples:
    """Prometheus text exposition as {(sample name, sorted labels): value}."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def scrape(address: str, timeout: float = 5.0) -> Samples:
    """The samples at `address` (host:port, or a URL)."""
    url = address if address.startswith("http") else f"http://{address}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse(resp.read().decode())


def by_labels(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """Sum of `name`'s samples grouped by the label values of `keys`."""
    acc: dict[tuple[str, ...], float] = defaultdict(float)
    for (n, labels), v in samples.items():
        if n == name:
            d = dict(labels)
            acc[tuple(d.get(k, "") for k in keys)] += v
    return dict(acc)


def shares(before: dict[K, float], after: dict[K, float], seconds: float) -> dict[K, float]:
    """Each key's growth between two reads of a seconds counter over the `seconds` between them,
    at most 1: the share of that time spent (busy seconds: how busy each worker was). Keys read
    only once, or whose count went down (the server started afresh between), are left out."""
    if seconds <= 0:
        return {}
    return {
        k: min((v - before[k]) / seconds, 1.0)
        for k, v in after.items()
        if k in before and v >= before[k]
    }
