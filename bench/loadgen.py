"""Load over gRPC, timed at the client (first token, every later token, the end). Open loop
(`run`): each request is sent at its arrival time whether or not earlier ones have finished.
Closed loop (`closed_loop`): a fixed number of clients, each waiting for its last answer."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from bench.trace import TraceRequest, prompt_ids
from pdserve_client import ClientAuth
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc

PATHS = {pb.PATH_COLOCATED: "colocated", pb.PATH_DISAGGREGATED: "disaggregated"}


@dataclass(slots=True)
class RequestResult:
    index: int
    prompt_len: int
    output_len: int
    sent_s: float  # since the start of the run
    ttft_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # since the start, one per token
    e2e_s: float | None = None
    tokens: int = 0
    status: str = "OK"  # a gRPC status code name
    error: str = ""  # the server's message where the status is not OK
    path: str = ""
    # Its prompt tokens found in the prefix cache of the worker that prefilled it.
    cached_tokens: int = 0
    router_ttft_s: float | None = None
    retry_after_ms: int | None = None  # RESOURCE_EXHAUSTED: the server's hint, when it gave one
    reject_reason: str = ""  # RESOURCE_EXHAUSTED: pdserve-reject-reason
    # Where the router placed it and why (its summary): the prefill worker ("" when colocated),
    # the decode worker, the decision's reason, and why its KV never came, if it did not.
    prefill_worker: str = ""
    decode_worker: str = ""
    decision_reason: str = ""
    kv_fallback: str = ""
    # What the router predicted for the placement it took (FinalInfo.predictions): its TTFT and
    # its p99 inter-token gap (None: not told, as where its prefill moved to another worker).
    predicted_ttft_s: float | None = None
    predicted_itl_p99_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "OK" and self.tokens == self.output_len

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "sent_s": self.sent_s,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "tokens": self.tokens,
            "status": self.status,
            "error": self.error,
            "path": self.path,
            "cached_tokens": self.cached_tokens,
            "router_ttft_s": self.router_ttft_s,
            "retry_after_ms": self.retry_after_ms,
            "reject_reason": self.reject_reason,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "decision_reason": self.decision_reason,
            "kv_fallback": self.kv_fallback,
            "predicted_ttft_s": self.predicted_ttft_s,
            "predicted_itl_p99_s": self.predicted_itl_p99_s,
            "itl_s": self.itl_s,
        }


async def _one(
    stub: pb_grpc.GenerationStub,
    req: pb.GenerateRequest,
    res: RequestResult,
    t0: float,
    timeout: float,
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    sent = time.monotonic()
    try:
        async for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
            now = time.monotonic()
            if msg.token_ids:
                if res.ttft_s is None:
                    res.ttft_s = now - sent
                # Tokens of one message arrived together.
                res.token_times_s.extend([now - t0] * len(msg.token_ids))
                res.tokens += len(msg.token_ids)
            if msg.HasField("final"):
                final = msg.final
                res.path = PATHS.get(final.path, "")
                res.router_ttft_s = final.ttft_ms / 1000
                res.cached_tokens = final.usage.cached_prompt_tokens
                res.prefill_worker, res.decode_worker = final.prefill_worker, final.decode_worker
                res.decision_reason, res.kv_fallback = final.decision_reason, final.kv_fallback
                taken = (final.path, final.prefill_worker, final.decode_worker)
                chosen = [
                    p
                    for p in final.predictions
                    if (p.path, p.prefill_worker, p.decode_worker) == taken
                ]
                if chosen:
                    res.predicted_ttft_s = chosen[0].ttft_ms / 1000
                    res.predicted_itl_p99_s = chosen[0].itl_p99_ms / 1000
        res.e2e_s = time.monotonic() - sent
    except grpc.aio.AioRpcError as exc:
        res.status = exc.code().name
        res.error = (exc.details() or "")[:300]
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            meta = {k: v for k, v in exc.trailing_metadata() or ()}
            hint = meta.get("retry-after-ms")
            res.retry_after_ms = int(hint) if isinstance(hint, str) and hint.isdigit() else None
            res.reject_reason = str(meta.get("pdserve-reject-reason", ""))


async def run(
    address: str,
    trace: Sequence[TraceRequest],
    rate: float,
    vocab: int,
    seed: int,
    timeout: float = 600.0,
    on_done: Callable[[RequestResult], None] | None = None,
    slo_hint: tuple[float, float] | None = None,
    auth: ClientAuth | None = None,
    on_sent: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send `trace` at `rate` requests/s (arrival_s / rate); results in trace order.
    `slo_hint` (TTFT s, ITL s) goes with every request, for the router's admission and policy.
    `auth`: TLS and the bearer token, for a server that asks for them. `on_sent` sees each
    result as its request leaves (it fills in as the answer comes)."""
    auth = auth or ClientAuth()
    async with auth.aio_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        stub = pb_grpc.GenerationStub(channel)
        results = [
            RequestResult(i, r.prompt_len, r.output_len, r.arrival_s / rate)
            for i, r in enumerate(trace)
        ]
        reqs = [_request(r, i, vocab, seed) for i, r in enumerate(trace)]
        if slo_hint is not None:
            for req in reqs:
                req.slo.ttft_ms, req.slo.itl_ms = slo_hint[0] * 1000, slo_hint[1] * 1000
        t0 = time.monotonic()
        tasks = []
        for req, res in zip(reqs, results):
            delay = t0 + res.sent_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if on_sent is not None:
                on_sent(res)
            tasks.append(
                asyncio.ensure_future(
                    _done(_one(stub, req, res, t0, timeout, auth.metadata), res, on_done)
                )
            )
        await asyncio.gather(*tasks)
    return results


async def _done(
    work: Awaitable[None],
    res: RequestResult,
    on_done: Callable[[RequestResult], None] | None,
) -> None:
    await work
    if on_done is not None:
        on_done(res)


def _request(r: TraceRequest, index: int, vocab: int, seed: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
    if r.prompt_text is not None:
        return pb.GenerateRequest(prompt=r.prompt_text, sampling=sampling)
    return pb.GenerateRequest(prompt_token_ids=prompt_ids(r, index, vocab, seed), sampling=sampling)


async def closed_loop(
    address: str,
    shapes: Sequence[TraceRequest],
    concurrency: int,
    duration_s: float,
    vocab: int,
    seed: int,
    timeout: float = 600.0,
    auth: ClientAuth | None = None,
) -> list[RequestResult]:
    """`concurrency` clients, each sending its next request as soon as its last one has ended,
    for `duration_s` (shapes taken in order, cycled; each prompt its own tokens). A refused
    request waits its retry-after hint before the next. Every result, in sending order."""
    auth = auth or ClientAuth()
    results: list[RequestResult] = []
    async with auth.aio_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        stub = pb_grpc.GenerationStub(channel)
        t0 = time.monotonic()
        numbers = itertools.count()

        async def client() -> None:
            while time.monotonic() - t0 < duration_s:
                i = next(numbers)
                r = shapes[i % len(shapes)]
                res = RequestResult(i, r.prompt_len, r.output_len, time.monotonic() - t0)
                results.append(res)
                await _one(stub, _request(r, i, vocab, seed), res, t0, timeout, auth.metadata)
                if res.status == "RESOURCE_EXHAUSTED":
                    await asyncio.sleep((res.retry_after_ms or 100) / 1000)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results
