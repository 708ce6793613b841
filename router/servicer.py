"""The gRPC front door: pdserve.v1.Generation over grpc.aio, plus the standard health and
reflection services. Only this module (and convert.py) touch protobuf types; the request core
sees dataclasses.

Status codes: INVALID_ARGUMENT names the field (including a string field that is not UTF-8,
which protobuf itself would only report as a parse failure); RESOURCE_EXHAUSTED carries
`retry-after-ms` and `pdserve-reject-reason` in the trailing metadata; UNAVAILABLE when a worker
failed under the request. A client that cancels, or whose deadline passes, stops the handler,
which aborts the request on every worker it touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import InvalidRequestError
from engine.outputs import TokenLogprobs
from pdserve_proto import generation_pb2 as pb
from router.client_limit import ClientLimit
from router.convert import PATH_TO_WIRE, invalid_utf8_field, request_fields
from router.core import RequestCore
from router.core_types import CoreChunk, NoWorkers, Overloaded, Summary
from router.errors import HandoffFailed, WorkerLost, worker_failure
from router.request import ModelLimits, ParsedRequest, check_request_async
from router.vocab import FinishReason

SERVICE = "pdserve.v1.Generation"
FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
log = logging.getLogger("pdserve.servicer")


class _BadWire:
    """A request protobuf refused to parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message


def _deserialize(raw: bytes) -> pb.GenerateRequest | _BadWire:
    try:
        return pb.GenerateRequest.FromString(raw)
    except DecodeError as exc:
        field = invalid_utf8_field(raw)
        if field is not None:
            return _BadWire(field, "is not valid UTF-8")
        return _BadWire("request", f"could not be parsed: {exc}")


def _logprobs(lps: tuple[TokenLogprobs, ...]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in lps
    ]


def _final(s: Summary) -> pb.FinalInfo:
    info = pb.FinalInfo(
        finish_reason=FINISH[s.finish_reason] if s.finish_reason else pb.FINISH_REASON_UNSPECIFIED,
        usage=pb.Usage(
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens,
            cached_prompt_tokens=s.cached_prompt_tokens,
        ),
        path=PATH_TO_WIRE[s.path],
        prefill_worker=s.prefill_worker,
        decode_worker=s.decode_worker,
        ttft_ms=s.ttft_s * 1000,
        predictions=[
            pb.PathPrediction(
                path=PATH_TO_WIRE[p.path],
                ttft_ms=p.ttft_s * 1000,
                itl_ms=p.itl_s * 1000,
                prefill_worker=p.prefill_worker,
                decode_worker=p.decode_worker,
            )
            for p in s.decision.best
        ],
        decision_reason=s.decision.reason,
        kv_fallback=s.kv_fallback.value if s.kv_fallback is not None else "",
    )
    if isinstance(s.stop_reason, str):
        info.stop_string = s.stop_reason
    elif isinstance(s.stop_reason, int):
        info.stop_token_id = s.stop_reason
    return info


async def _refuse(context: grpc.aio.ServicerContext, exc: Overloaded) -> NoReturn:
    """RESOURCE_EXHAUSTED with the reason and a retry hint in the trailing metadata."""
    context.set_trailing_metadata(
        (
            ("retry-after-ms", str(max(1, round(exc.retry_after_s * 1000)))),
            ("pdserve-reject-reason", exc.reason.value),
        )
    )
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    raise AssertionError("unreachable: abort raises")


def _client(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for per-client limits: the peer's address without its port."""
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


class GenerationServicer:
    def __init__(
        self,
        core: RequestCore,
        tokenizer: Any,
        limits: ModelLimits,
        model: str,
        clients: ClientLimit | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.limits = limits
        self.model = model
        self.clients = clients or ClientLimit(None, core.sink)  # --max-streams-per-client

    async def Info(  # noqa: N802
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoResponse:
        b = self.core.backend
        return pb.InfoResponse(
            model=self.model,
            vocab_size=self.limits.vocab_size,
            max_model_len=self.limits.max_model_len,
            prefill_workers=list(b.prefill_ids),
            decode_workers=list(b.decode_ids),
            policy=self.core.planner.config.policy.value,
        )

    async def _parse(
        self, request: pb.GenerateRequest | _BadWire, context: grpc.aio.ServicerContext
    ) -> ParsedRequest:
        try:
            if isinstance(request, _BadWire):
                raise InvalidRequestError(request.field, request.message)
            fields = request_fields(request)
            return await check_request_async(fields, self.tokenizer, self.limits)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort raises; this line is never reached

    async def _chunks(
        self, req: ParsedRequest, arrived: float, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[CoreChunk, None]:
        try:
            release = self.clients.take(_client(context))
        except Overloaded as exc:
            await _refuse(context, exc)
        try:
            # Closed here, not left to the garbage collector: closing aborts the request.
            async with contextlib.aclosing(self._core_chunks(req, arrived, context)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            release()

    async def _core_chunks(
        self, req: ParsedRequest, arrived: float, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[CoreChunk, None]:
        stream = self.core.generate(req, arrived)
        try:
            async for chunk in stream:
                yield chunk
        except Overloaded as exc:
            await _refuse(context, exc)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except (NoWorkers, WorkerLost, HandoffFailed) as exc:
            log.warning("request %s: %s", req.request_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            code = grpc.StatusCode.INTERNAL
            if worker_failure(exc):
                code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"request failed: {type(exc).__name__}: {exc}")
        finally:
            await stream.aclose()

    async def Generate(  # noqa: N802 (the RPC's name)
        self, request: pb.GenerateRequest | _BadWire, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrived = time.monotonic()
        req = await self._parse(request, context)
        async with contextlib.aclosing(self._chunks(req, arrived, context)) as chunks:
            async for c in chunks:
                yield pb.GenerateResponse(
                    request_id=c.request_id,
                    token_ids=c.token_ids,
                    text=c.text,
                    logprobs=_logprobs(c.logprobs),
                    final=_final(c.final) if c.final is not None else None,
                )

    async def Complete(  # noqa: N802
        self, request: pb.GenerateRequest | _BadWire, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        arrived = time.monotonic()
        req = await self._parse(request, context)
        ids: list[int] = []
        text: list[str] = []
        lps: list[TokenLogprobs] = []
        final: Summary | None = None
        async with contextlib.aclosing(self._chunks(req, arrived, context)) as chunks:
            async for c in chunks:
                ids.extend(c.token_ids)
                text.append(c.text)
                lps.extend(c.logprobs)
                final = c.final or final
        return pb.CompleteResponse(
            request_id=req.request_id,
            token_ids=ids,
            text="".join(text),
            logprobs=_logprobs(tuple(lps)),
            final=_final(final) if final is not None else None,
        )


async def add_services(server: grpc.aio.Server, servicer: GenerationServicer) -> Any:
    """Register Generation, health (SERVING) and reflection on `server`; returns the health
    servicer so that shutdown can report NOT_SERVING first."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_deserialize,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Complete": grpc.unary_unary_rpc_method_handler(
            servicer.Complete,
            request_deserializer=_deserialize,
            response_serializer=pb.CompleteResponse.SerializeToString,
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=pb.InfoRequest.FromString,
            response_serializer=pb.InfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return health_servicer
