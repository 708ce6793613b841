"""What the router itself costs: the real server (servicer, parsing and tokenizing, admission,
cost model, books) with the workers replaced by an instant fake, driven over gRPC on 127.0.0.1.

    python -m router.overhead_bench [--seconds 5] [--concurrency 64] [--json FILE]

The server runs in this process; the load comes from a separate client process, so the two do
not share an interpreter. Figures, in one run:
  - unary requests/s: `Complete` calls with `--concurrency` in flight, for `--seconds`;
  - added latency: the median round trip of one `Complete` at a time through the router, minus
    the same through a bare gRPC server on the same port kind whose handler answers at once (the
    floor of gRPC itself on this machine).
Requests carry a text prompt (the default model's tokenizer runs) and ask for 16 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

PROMPT = "What is the capital of France? Answer in one short sentence, please."
MAX_TOKENS = 16


def _request() -> Any:
    from pdserve_proto import generation_pb2 as pb

    return pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )


async def _load(address: str, seconds: float, concurrency: int) -> dict[str, float]:
    import grpc

    from pdserve_proto import generation_pb2_grpc as pb_grpc

    req = _request()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await stub.Complete(req, timeout=10)  # connect and warm up
        lat: list[float] = []
        for _ in range(300):  # one at a time: latency
            t0 = time.perf_counter()
            await stub.Complete(req, timeout=10)
            lat.append(time.perf_counter() - t0)
        done = 0
        errors = 0
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < stop:
                try:
                    await stub.Complete(req, timeout=10)
                    done += 1
                except grpc.RpcError:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    lat.sort()
    return {
        "rps": done / elapsed,
        "errors": errors,
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1000,
    }


def _client(address: str, seconds: float, concurrency: int, out: Any) -> None:
    out.put(asyncio.run(_load(address, seconds, concurrency)))


def _drive(address: str, seconds: float, concurrency: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_client, args=(address, seconds, concurrency, q))
    proc.start()
    try:
        return q.get(timeout=seconds + 120)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


class _Bare:
    """A Generation server whose Complete answers at once, with no router behind it."""

    async def Complete(self, request: Any, context: Any) -> Any:  # noqa: N802
        from pdserve_proto import generation_pb2 as pb

        return pb.CompleteResponse(request_id="bare", token_ids=range(MAX_TOKENS), text="x" * 16)


async def _bare_server() -> tuple[Any, int]:
    import grpc

    from pdserve_proto import generation_pb2 as pb

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        _Bare().Complete,
        request_deserializer=pb.GenerateRequest.FromString,
        response_serializer=pb.CompleteResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.v1.Generation", {"Complete": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.config import ModelConfig
    from engine.loader import load_tokenizer
    from router.fake_backend import FakeBackend
    from router.server import ServeConfig, Server

    tokenizer = load_tokenizer(ModelConfig(model=args.model))
    backend = FakeBackend(
        num_prefill=1, num_decode=1, vocab_size=len(tokenizer), chunk_tokens=MAX_TOKENS
    )
    server = Server(ServeConfig(port=0, metrics_port=0), backend=backend, tokenizer=tokenizer)
    await server.start()
    loop = asyncio.get_running_loop()
    try:
        routed = await loop.run_in_executor(
            None, _drive, server.address, args.seconds, args.concurrency
        )
    finally:
        await server.stop()
    bare_server, port = await _bare_server()
    try:
        bare = await loop.run_in_executor(
            None, _drive, f"127.0.0.1:{port}", args.seconds, args.concurrency
        )
    finally:
        await bare_server.stop(1)
    return {
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "router": routed,
        "bare_grpc": bare,
        "added_p50_ms": routed["p50_ms"] - bare["p50_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.overhead_bench", description=__doc__)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--model", default="smollm2-135m", help="whose tokenizer the router runs")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = asyncio.run(_run(args))
    r, b = res["router"], res["bare_grpc"]
    print(f"{'':>22} {'unary req/s':>12} {'p50 ms':>8} {'p99 ms':>8}")
    print(
        f"{'router + instant fake':>22} {r['rps']:>12.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}"
    )
    print(f"{'bare gRPC handler':>22} {b['rps']:>12.0f} {b['p50_ms']:>8.2f} {b['p99_ms']:>8.2f}")
    print(
        f"added by the router, median: {res['added_p50_ms']:.2f} ms "
        f"(targets: >= 2000 req/s, < 1 ms)"
    )
    if r["errors"]:
        print(f"errors: {r['errors']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
