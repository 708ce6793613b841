"""How long the pools' lifecycle takes on this machine: starting 1 prefill + 1 decode worker
(placed, engine up, paired, warm), replacing a decode worker killed by its process id (noticed
by a load poll as the router does, then a new actor up, paired and warm), and a live resize
1+1 -> 2+2 -> 1+1 (idle workers: the drain ends at once). Local Ray on 127.0.0.1.

    python -m router.lifecycle_bench --model smollm2-135m --json benchmarks/lifecycle.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections.abc import Callable

from engine.config import CacheConfig, EngineConfig
from engine.provenance import provenance, write_json
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.vocab import Placement, RoutePath


async def _ttft(cluster: Cluster, path: RoutePath) -> float:
    t0 = time.monotonic()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = None
    async for chunk in cluster.generate(list(range(1, 65)), params, Placement(path=path)):
        if first is None and chunk.token_ids:
            first = time.monotonic() - t0
    assert first is not None
    return first


def _until(pred: Callable[[], bool], timeout_s: float, poll: Callable[[], None]) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"not done within {timeout_s:.0f} s")
        poll()
        time.sleep(0.1)
    return time.monotonic() - t0


def measure(model: str, kv_cache_gib: float) -> dict[str, float]:
    engine = EngineConfig(cache=CacheConfig(cpu_kv_cache_gib=kv_cache_gib))
    config = ClusterConfig(model=model, num_prefill=1, num_decode=1, engine=engine)
    out: dict[str, float] = {}
    t0 = time.monotonic()
    cluster = Cluster(config)
    out["start_1p1d_s"] = time.monotonic() - t0
    try:
        out["ttft_colocated_s"] = asyncio.run(_ttft(cluster, RoutePath.COLOCATED))
        out["ttft_disaggregated_s"] = asyncio.run(_ttft(cluster, RoutePath.DISAGGREGATED))
        old = cluster.worker_info("decode-0")
        t0 = time.monotonic()
        os.kill(old.pid, signal.SIGKILL)

        def poll() -> None:
            asyncio.run(cluster.load())  # what the router's poller does every 0.1 s

        _until(lambda: "decode-0" not in cluster.decode_ids, 30, poll)
        out["death_noticed_s"] = time.monotonic() - t0
        _until(lambda: cluster.decode_ids == ["decode-0"], 300, poll)
        out["replace_decode_s"] = time.monotonic() - t0
        assert cluster.worker_info("decode-0").incarnation == old.incarnation + 1
        out["ttft_disaggregated_after_replace_s"] = asyncio.run(
            _ttft(cluster, RoutePath.DISAGGREGATED)
        )
        for name, (p, d) in (("scale_to_2p2d_s", (2, 2)), ("scale_to_1p1d_s", (1, 1))):
            t0 = time.monotonic()
            asyncio.run(cluster.scale(p, d, drain_timeout_s=30))
            out[name] = time.monotonic() - t0
        out["fallbacks"] = float(len(cluster.fallbacks))  # the request during the kill: 0
    finally:
        cluster.shutdown()
    return out


LABELS = {
    "start_1p1d_s": "start 1 prefill + 1 decode (placed, up, paired, warm)",
    "ttft_colocated_s": "TTFT colocated, 64-token prompt",
    "ttft_disaggregated_s": "TTFT disaggregated, 64-token prompt",
    "death_noticed_s": "decode worker killed -> out of its pool",
    "replace_decode_s": "decode worker killed -> replacement takes load",
    "ttft_disaggregated_after_replace_s": "TTFT disaggregated through the replacement",
    "scale_to_2p2d_s": "scale 1+1 -> 2+2 (new workers take load)",
    "scale_to_1p1d_s": "scale 2+2 -> 1+1 (idle: drained at once, stopped)",
    "fallbacks": "handoffs that fell back",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router.lifecycle_bench", description=__doc__)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    made = provenance()  # at the start: when it started, from which checkout
    figures = measure(args.model, args.kv_cache_gib)
    print(f"pdserve lifecycle on this machine, model {args.model}")
    for key, label in LABELS.items():
        value = figures[key]
        shown = f"{value:.0f}" if key == "fallbacks" else f"{value:.2f} s"
        print(f"  {label:<58} {shown:>9}")
    if args.json:
        write_json(args.json, rounded({"model": args.model, **figures}), made)
    return 0


def rounded(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


if __name__ == "__main__":
    raise SystemExit(main())
