"""`python -m router.handoff_bench`: what the disaggregated handoff costs, on this machine.

For each prompt length, with one prefill and one decode worker on Ray (127.0.0.1):
  prefill_only_s   the same prompt prefilled by an in-process engine with the same threads (no Ray,
                   no transfer): the floor for time to first token;
  colocated_ttft_s time to the first streamed token, decode worker prefilling itself;
  disagg_ttft_s    time to the first streamed token, prefill worker + KV transfer + decode worker;
and the streaming overhead per token: from the moment a worker hands a token over to the moment
the client here has it (both read time.monotonic(), one clock per host). Each measurement uses a
fresh random prompt, so no prefix-cache hit flatters it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.provenance import provenance, write_json
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.vocab import Placement, RoutePath


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    low = 1000 if vocab > 2000 else 0
    return torch.randint(
        low, min(vocab, 256) if vocab <= 2000 else vocab, (n,), generator=g
    ).tolist()


async def timed_stream(
    cluster: Cluster, ids: list[int], path: RoutePath, n_out: int
) -> tuple[float, list[float], list[float]]:
    """(TTFT, inter-token times, per-token delivery delay worker -> here)."""
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    stamps, delays = [], []
    async for chunk in cluster.generate(ids, params, Placement(path=path)):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            delays.append(time.monotonic() - chunk.emitted_at)
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], delays


def engine_times(engine: LLMEngine, ids: list[int], n_out: int) -> tuple[float, float]:
    """(prefill to first token, mean decode step) for one request alone, in process."""
    rid = engine.add_request(
        ids, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    )
    t0 = time.perf_counter()
    stamps = []
    while engine.has_unfinished_requests():
        if any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, statistics.mean(steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router.handoff_bench", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-lens", default="256,1024")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    made = provenance()  # at the start: when it started, from which checkout
    lens = [int(x) for x in args.prompt_lens.split(",")]
    torch.set_num_threads(args.threads)
    engine_cfg = EngineConfig(
        model=ModelConfig(model=args.model), cache=CacheConfig(cpu_kv_cache_gib=0.5)
    )
    local = LLMEngine(engine_cfg)
    vocab = local.vocab_size
    cluster = Cluster(
        ClusterConfig(model=args.model, engine=engine_cfg, threads_per_worker=args.threads)
    )
    rows = []
    try:
        # Warm both paths (first calls pay for pairing and allocation).
        asyncio.run(timed_stream(cluster, prompt(32, vocab, 1), RoutePath.COLOCATED, 2))
        asyncio.run(timed_stream(cluster, prompt(32, vocab, 2), RoutePath.DISAGGREGATED, 2))
        local.generate([prompt(32, vocab, 3)], SamplingParams(max_tokens=2, temperature=0))
        for i, n in enumerate(lens):
            pre, step = engine_times(local, prompt(n, vocab, 100 + i), args.output_tokens)
            co, co_itl, co_delay = asyncio.run(
                timed_stream(
                    cluster, prompt(n, vocab, 200 + i), RoutePath.COLOCATED, args.output_tokens
                )
            )
            dis, dis_itl, dis_delay = asyncio.run(
                timed_stream(
                    cluster, prompt(n, vocab, 300 + i), RoutePath.DISAGGREGATED, args.output_tokens
                )
            )
            rows.append(
                {
                    "prompt_tokens": n,
                    "prefill_only_s": pre,
                    "colocated_ttft_s": co,
                    "disagg_ttft_s": dis,
                    "disagg_over_prefill": dis / pre,
                    "engine_step_s": step,
                    "colocated_itl_s": statistics.mean(co_itl),
                    "disagg_itl_s": statistics.mean(dis_itl),
                    # Worker hands a token over -> the client has it (Ray streaming + this loop).
                    "stream_overhead_per_token_s": statistics.mean(co_delay + dis_delay),
                    "stream_overhead_p99_s": sorted(co_delay + dis_delay)[
                        int(0.99 * (len(co_delay) + len(dis_delay) - 1))
                    ],
                }
            )
    finally:
        cluster.shutdown()
    print(f"\nmodel {args.model}, {args.threads} thread(s) per worker")
    print(
        f"{'prompt':>7}{'prefill':>10}{'coloc TTFT':>12}{'disagg TTFT':>13}{'ratio':>7}"
        f"{'step':>8}{'coloc ITL':>11}{'overhead/tok':>14}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7}{r['prefill_only_s']:>9.3f}s{r['colocated_ttft_s']:>11.3f}s"
            f"{r['disagg_ttft_s']:>12.3f}s{r['disagg_over_prefill']:>7.2f}"
            f"{r['engine_step_s'] * 1e3:>6.1f}ms{r['colocated_itl_s'] * 1e3:>9.1f}ms"
            f"{r['stream_overhead_per_token_s'] * 1e3:>12.2f}ms"
        )
    if args.json:
        write_json(args.json, {"model": args.model, "threads": args.threads, "rows": rows}, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
