"""What the router itself costs: the real server (a front door, parsing and tokenizing,
admission, cost model, books) with the workers replaced by an instant fake, driven over gRPC and
over the HTTP API on 127.0.0.1.

    python -m router.overhead_bench [--frontend both|grpc|http] [--seconds 5] [--concurrency 64]
                                    [--json FILE]

The server runs in this process; the load comes from a separate client process, so the two do
not share an interpreter. Figures, per front door, in one run:
  - unary requests/s: whole (not streamed) requests with `--concurrency` in flight, for
    `--seconds`: gRPC `Complete`, or HTTP POST /v1/completions;
  - added latency: the median round trip of one request at a time through the router, minus
    the same through a bare server of the same kind whose handler answers at once (a gRPC
    handler; for HTTP an ASGI handler on the same FastAPI and uvicorn stack): the floor of the
    protocol itself on this machine.
Requests carry a text prompt (the default model's tokenizer runs) and ask for 16 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine.provenance import provenance, write_json

PROMPT = "What is the capital of France? Answer in one short sentence, please."
MAX_TOKENS = 16


def _request() -> Any:
    from pdserve_proto import generation_pb2 as pb

    return pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )


async def _load(address: str, seconds: float, concurrency: int) -> dict[str, float]:
    if address.startswith("http://"):
        import httpx2

        body = {"model": "bench", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        limits = httpx2.Limits(max_connections=concurrency)
        async with httpx2.AsyncClient(base_url=address, timeout=10, limits=limits) as http:

            async def call() -> None:
                (await http.post("/v1/completions", json=body)).raise_for_status()

            return await _measure(call, seconds, concurrency)
    import grpc

    from pdserve_proto import generation_pb2_grpc as pb_grpc

    req = _request()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def rpc() -> None:
            await stub.Complete(req, timeout=10)

        return await _measure(rpc, seconds, concurrency)


async def _measure(
    call: Callable[[], Awaitable[None]], seconds: float, concurrency: int
) -> dict[str, float]:
    await call()  # connect and warm up
    lat: list[float] = []
    for _ in range(300):  # one at a time: latency
        t0 = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t0)
    done = 0
    errors = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            try:
                await call()
                done += 1
            except Exception:
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


def _bare_app() -> Any:
    """An ASGI app on the same stack as the HTTP API whose handler answers at once."""
    from fastapi import FastAPI

    app = FastAPI()
    answer = {
        "id": "cmpl-bare",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "text": "x" * 16, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 16, "completion_tokens": MAX_TOKENS, "total_tokens": 32},
    }

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        return answer

    return app


async def _bare_http() -> tuple[Any, int]:
    from router.http_server import HttpServer
    from router.security import SecurityConfig

    server = HttpServer(_bare_app(), "127.0.0.1", 0, SecurityConfig(), grace_s=1)
    await server.start()
    return server, server.port


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.config import ModelConfig
    from engine.loader import load_tokenizer
    from router.cluster_config import ClusterConfig
    from router.fake_backend import FakeBackend
    from router.serve_config import ServeConfig
    from router.server import Server

    tokenizer = load_tokenizer(ModelConfig(model=args.model))
    backend = FakeBackend(
        num_prefill=1, num_decode=1, vocab_size=len(tokenizer), chunk_tokens=MAX_TOKENS
    )
    doors = ["grpc", "http"] if args.frontend == "both" else [args.frontend]
    config = ServeConfig(cluster=ClusterConfig(model="bench"), port=0, metrics_port=0, http_port=0)
    server = Server(config, backend=backend, tokenizer=tokenizer)
    await server.start()
    loop = asyncio.get_running_loop()
    out: dict[str, Any] = {"concurrency": args.concurrency, "seconds": args.seconds}
    try:
        for door in doors:
            address = (
                server.address
                if door == "grpc"
                else f"http://{server.config.host}:{server.http_port}"
            )
            out[door] = {
                "router": await loop.run_in_executor(
                    None, _drive, address, args.seconds, args.concurrency
                )
            }
    finally:
        await server.stop()
    for door in doors:
        if door == "grpc":
            bare_grpc, port = await _bare_server()
            try:
                bare = await loop.run_in_executor(
                    None, _drive, f"127.0.0.1:{port}", args.seconds, args.concurrency
                )
            finally:
                await bare_grpc.stop(1)
        else:
            bare_http, port = await _bare_http()
            try:
                bare = await loop.run_in_executor(
                    None, _drive, f"http://127.0.0.1:{port}", args.seconds, args.concurrency
                )
            finally:
                await bare_http.stop()
        out[door]["bare"] = bare
        out[door]["added_p50_ms"] = out[door]["router"]["p50_ms"] - bare["p50_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.overhead_bench", description=__doc__)
    p.add_argument("--frontend", choices=("both", "grpc", "http"), default="both")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--model", default="smollm2-135m", help="whose tokenizer the router runs")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    made = provenance()  # at the start: when it started, from which checkout
    res = asyncio.run(_run(args))
    print(f"{'':>28} {'unary req/s':>12} {'p50 ms':>8} {'p99 ms':>8}")
    for door in ("grpc", "http"):
        if door not in res:
            continue
        r, b = res[door]["router"], res[door]["bare"]
        bare = "bare gRPC handler" if door == "grpc" else "bare ASGI handler"
        for name, x in ((f"{door}: router + instant fake", r), (f"{door}: {bare}", b)):
            print(f"{name:>28} {x['rps']:>12.0f} {x['p50_ms']:>8.2f} {x['p99_ms']:>8.2f}")
        print(f"{door}: added by the router, median: {res[door]['added_p50_ms']:.2f} ms")
        if r["errors"]:
            print(f"{door}: errors: {r['errors']}")
    print("(targets, gRPC: >= 2000 req/s, < 1 ms added)")
    if args.json:
        write_json(args.json, res, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
