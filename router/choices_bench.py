"""`python -m router.choices_bench`: what a request's n choices (HTTP's `n`) cost when they start
together, against choice 0 first and the others at its first token (router/http_choices.py), on
one prefill and one decode worker on Ray (127.0.0.1).

For each prompt length, path and order, side by side: the time until every choice has its first
token (when an answer with n choices starts), until every choice has ended, and the KV bytes
the decode worker received. Each measurement uses a fresh random prompt, so that no earlier one
leaves it in a prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.provenance import provenance, write_json
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.handoff_bench import prompt
from router.vocab import Placement, RoutePath

ORDERS = ("together", "first")  # first: choice 0 first, the others at its first token


async def _choice(
    cluster: Cluster, ids: list[int], path: RoutePath, n_out: int, t0: float, first: asyncio.Event
) -> tuple[float, float]:
    """(first token, end), seconds since t0; sets `first` at the first token."""
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    token_s = None
    async for chunk in cluster.generate(ids, params, Placement(path=path)):
        if chunk.token_ids and token_s is None:
            token_s = time.perf_counter() - t0
            first.set()
    if token_s is None:
        raise RuntimeError("a choice ended without a token")
    return token_s, time.perf_counter() - t0


async def _received(cluster: Cluster) -> int:
    stats = await cluster.kv_stats()
    return sum(s.bytes_received for s in stats.values())


async def choices(
    cluster: Cluster, ids: list[int], path: RoutePath, n: int, n_out: int, order: str
) -> dict:
    before = await _received(cluster)
    t0 = time.perf_counter()
    firsts = [asyncio.Event() for _ in range(n)]
    if order == "first":
        zero = asyncio.ensure_future(_choice(cluster, ids, path, n_out, t0, firsts[0]))
        first = asyncio.ensure_future(firsts[0].wait())
        rest: list[asyncio.Future[tuple[float, float]]] = []
        try:
            await asyncio.wait((zero, first), return_when=asyncio.FIRST_COMPLETED)
            if zero.done():
                await zero  # raises where it ended before its first token
            rest = [asyncio.ensure_future(_choice(cluster, ids, path, n_out, t0, e))
                    for e in firsts[1:]]  # fmt: skip
            times = await asyncio.gather(zero, *rest)
        finally:
            for t in [zero, *rest]:
                t.cancel()  # a no-op once it is done
            first.cancel()
    else:
        times = await asyncio.gather(*(_choice(cluster, ids, path, n_out, t0, e) for e in firsts))
    return {
        "all_first_token_s": max(t for t, _ in times),
        "all_done_s": max(e for _, e in times),
        "kv_bytes": await _received(cluster) - before,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router.choices_bench", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-lens", default="256,1024")
    ap.add_argument("--choices", type=int, default=4, help="n")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.choices < 2:
        ap.error("--choices: at least 2 (one choice has no other to wait)")
    made = provenance()  # at the start: when it started, from which checkout
    lens = [int(x) for x in args.prompt_lens.split(",")]
    engine_cfg = EngineConfig(
        model=ModelConfig(model=args.model), cache=CacheConfig(cpu_kv_cache_gib=0.5)
    )
    cluster = Cluster(
        ClusterConfig(model=args.model, engine=engine_cfg, threads_per_worker=args.threads)
    )
    vocab = cluster.worker_info("decode-0").vocab_size
    rows = []
    seed = 1000
    try:
        for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED):  # warm both paths
            asyncio.run(choices(cluster, prompt(32, vocab, seed), path, 2, 2, "together"))
            seed += 1
        for n_tokens in lens:
            for path in (RoutePath.COLOCATED, RoutePath.DISAGGREGATED):
                row: dict = {"prompt_tokens": n_tokens, "path": path.value}
                for order in ORDERS:
                    ids = prompt(n_tokens, vocab, seed)
                    seed += 1
                    row[order] = asyncio.run(
                        choices(cluster, ids, path, args.choices, args.output_tokens, order)
                    )
                rows.append(row)
    finally:
        cluster.shutdown()
    print(f"\nmodel {args.model}, {args.choices} choices of {args.output_tokens} tokens, "
          f"{args.threads} thread(s) per worker; first: choice 0 first, the others at its first "
          f"token; ratio: first over together")  # fmt: skip
    print(f"{'prompt':>7} {'path':<14}{'all first tokens':>27}{'all ended':>27}{'KV bytes':>30}")
    print(f"{'':>22}{'together':>10}{'first':>9}{'ratio':>8}" * 2 + f"{'together':>12}"
          f"{'first':>11}{'ratio':>7}")  # fmt: skip
    for r in rows:
        t, f = r["together"], r["first"]
        cells = [f"{r['prompt_tokens']:>7} {r['path']:<14}"]
        for key in ("all_first_token_s", "all_done_s"):
            cells.append(f"{t[key]:>9.2f}s{f[key]:>8.2f}s{f[key] / t[key]:>8.2f}")
        ratio = f"{f['kv_bytes'] / t['kv_bytes']:.2f}" if t["kv_bytes"] else "-"
        cells.append(f"{t['kv_bytes']:>12}{f['kv_bytes']:>11}{ratio:>7}")
        print("".join(cells))
    if args.json:
        write_json(args.json, {"model": args.model, "choices": args.choices, "rows": rows}, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
