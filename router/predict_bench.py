"""How well the cost model predicts TTFT on a steady workload, measured through gRPC.

    python -m router.predict_bench [--model smollm2-135m] [--requests 60] [--warmup 20]
                                   [--rate 0.5] [--policy auto] [--json FILE]

Starts a server (one prefill and one decode worker, 1 torch thread each) in this process, sends
`--requests` requests at Poisson arrivals of `--rate` per second (prompt lengths uniform in
[--min-len, --max-len] random tokens, 16 output tokens, fixed seed), and compares, per request,
the TTFT the router predicted for the path it took (FinalInfo.predictions) with the TTFT it
measured (FinalInfo.ttft_ms). Reports the median relative error after the first `--warmup`
requests, overall and per path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from dataclasses import replace
from typing import Any

from engine.config import CacheConfig, EngineConfig
from engine.provenance import provenance, write_json

PATH_NAMES = {1: "colocated", 2: "disaggregated"}


async def _one(stub: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    from pdserve_proto import generation_pb2 as pb

    req = pb.GenerateRequest(
        prompt_token_ids=ids,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    final = None
    async for msg in stub.Generate(req, timeout=600):
        if msg.HasField("final"):
            final = msg.final
    assert final is not None
    pred = next(p for p in final.predictions if p.path == final.path)
    return {
        "prompt_tokens": len(ids),
        "path": PATH_NAMES[final.path],
        "predicted_ttft_ms": pred.ttft_ms,
        "measured_ttft_ms": final.ttft_ms,
        "reason": final.decision_reason,
    }


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import grpc

    from pdserve_proto import generation_pb2_grpc as pb_grpc
    from router.cluster import ClusterConfig
    from router.policy import Policy, PolicyConfig
    from router.serve_config import ServeConfig
    from router.server import Server

    rng = random.Random(args.seed)
    base = ServeConfig()
    config = ServeConfig(
        cluster=ClusterConfig(
            model=args.model,
            num_prefill=1,
            num_decode=1,
            engine=EngineConfig(cache=CacheConfig(cpu_kv_cache_gib=0.5)),
        ),
        router=replace(base.router, policy=PolicyConfig(policy=Policy(args.policy))),
        port=0,
        metrics_port=0,
    )
    server = Server(config)
    await server.start()
    try:
        vocab = server.core.states["decode-0"].info.vocab_size if server.core else 1000
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            tasks = []
            for _ in range(args.requests):
                n = rng.randint(args.min_len, args.max_len)
                ids = [rng.randrange(vocab) for _ in range(n)]
                tasks.append(asyncio.ensure_future(_one(stub, ids, args.max_tokens)))
                await asyncio.sleep(rng.expovariate(args.rate))
            return list(await asyncio.gather(*tasks))
    finally:
        await server.stop()


def _median_error(rows: list[dict[str, Any]]) -> float | None:
    errs = [
        abs(r["predicted_ttft_ms"] - r["measured_ttft_ms"]) / r["measured_ttft_ms"] for r in rows
    ]
    return statistics.median(errs) if errs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.predict_bench", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policy", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    made = provenance()  # at the start: when it started, from which checkout
    rows = asyncio.run(_run(args))
    steady = rows[args.warmup :]
    print(f"{'':>14} {'requests':>8} {'median |pred-meas|/meas':>24} {'median TTFT ms':>15}")
    summary: dict[str, Any] = {}
    for name in ("all", "colocated", "disaggregated"):
        group = [r for r in steady if name == "all" or r["path"] == name]
        if not group:
            continue
        err = _median_error(group)
        ttft = statistics.median(r["measured_ttft_ms"] for r in group)
        summary[name] = {"requests": len(group), "median_rel_error": err, "median_ttft_ms": ttft}
        print(f"{name:>14} {len(group):>8} {err:>24.1%} {ttft:>15.0f}")
    print(f"(after {args.warmup} warm-up requests; target: within 25% for the median request)")
    if args.json:
        write_json(args.json, {"args": vars(args), "summary": summary, "requests": rows}, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
