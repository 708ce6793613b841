"""The gRPC front door: pdserve.v1.Generation over grpc.aio, plus the standard health and
reflection services. Only this module (and convert.py) touch protobuf types; the request core
sees dataclasses.

Status codes: INVALID_ARGUMENT names the field (including a string field that is not UTF-8,
which protobuf itself would only report as a parse failure); RESOURCE_EXHAUSTED carries
`retry-after-ms` and `pdserve-reject-reason` in the trailing metadata; UNAVAILABLE when a worker
failed under the request; DEADLINE_EXCEEDED when a streamed answer was cut because its client
read none of it for client_limit.SEND_STALL_S. A client that cancels, or whose deadline passes,
stops the handler, which aborts the request on every worker it touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import InvalidRequestError
from pdserve_proto import generation_pb2 as pb
from router import client_limit
from router.client_limit import ClientLimit, client_host
from router.convert import final_to_wire, invalid_utf8_field, logprobs_to_wire, request_fields
from router.core import RequestCore
from router.core_types import CoreChunk, Overloaded, collect
from router.errors import failure_reason
from router.health import DrainingHealth
from router.refusal_log import Said
from router.request import ModelLimits, ParsedRequest, check_request_async
from router.vocab import FailureReason, Frontend

SERVICE = "pdserve.v1.Generation"
# How long a cut stream's status may wait to go out (behind the answer its client does not read)
# before its handler ends regardless.
CUT_STATUS_S = 5.0
STATUS = {
    FailureReason.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    FailureReason.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureReason.NO_WORKERS: grpc.StatusCode.UNAVAILABLE,
    FailureReason.WORKER_FAILED: grpc.StatusCode.UNAVAILABLE,
    FailureReason.HANDOFF_FAILED: grpc.StatusCode.UNAVAILABLE,
    FailureReason.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    FailureReason.INTERNAL: grpc.StatusCode.INTERNAL,
}
_WHY = {r: "" for r in FailureReason} | {
    FailureReason.WORKER_FAILED: "request failed: a worker failed: ",
    FailureReason.INTERNAL: "request failed: ",
}
log = logging.getLogger("pdserve.servicer")
_CUT = Said(log)


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
            release = self.clients.take(client_host(context.peer() or ""), Frontend.GRPC)
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
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            reason = failure_reason(exc)
            if isinstance(exc, Overloaded):
                await _refuse(context, exc)
            if reason is FailureReason.INTERNAL:
                log.exception("request %s failed", req.request_id)
            elif reason is not FailureReason.INVALID:
                log.warning("request %s: %s: %s", req.request_id, type(exc).__name__, exc)
            detail = str(exc)
            if isinstance(exc, InvalidRequestError):  # from its parts, as Ray's str() is long
                detail = f"{exc.field}: {getattr(exc, 'message', exc)}"
            if reason is FailureReason.INTERNAL:
                detail = f"{type(exc).__name__}: {exc}"
            await context.abort(STATUS[reason], f"{_WHY[reason]}{detail}")
        finally:
            await stream.aclose()

    async def Generate(  # noqa: N802 (the RPC's name)
        self, request: pb.GenerateRequest | _BadWire, context: grpc.aio.ServicerContext
    ) -> None:
        arrived = time.monotonic()
        req = await self._parse(request, context)
        opened = False
        async with contextlib.aclosing(self._chunks(req, arrived, context)) as chunks:
            async for c in chunks:
                message = pb.GenerateResponse(
                    request_id=c.request_id,
                    token_ids=c.token_ids,
                    text=c.text,
                    logprobs=logprobs_to_wire(c.logprobs),
                    final=final_to_wire(c.final) if c.final is not None else None,
                    prompt_logprobs=logprobs_to_wire(c.prompt_logprobs),
                )
                if not opened:  # the headers (not held back by flow control) first
                    await context.send_initial_metadata(())
                    opened = True
                try:
                    async with asyncio.timeout(client_limit.SEND_STALL_S):
                        await context.write(message)
                except TimeoutError:
                    if c.final is not None:
                        return  # the request has ended anyway
                    break  # closing the chunks ends the request before the status waits
            else:
                return
        stall = client_limit.SEND_STALL_S
        _CUT.say(time.monotonic(), "gRPC stream %s cut: its client read none of its answer for "
                 "%g s", req.request_id, stall)  # fmt: skip
        del req, chunks, request, c, message  # none of it held while the status waits
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CUT_STATUS_S):
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"answer cut: the client read none of it for {stall:g} s",
                )

    async def Complete(  # noqa: N802
        self, request: pb.GenerateRequest | _BadWire, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        arrived = time.monotonic()
        req = await self._parse(request, context)
        async with contextlib.aclosing(self._chunks(req, arrived, context)) as chunks:
            answer = await collect(chunks)
        return pb.CompleteResponse(
            request_id=req.request_id,
            token_ids=answer.token_ids,
            text=answer.text,
            logprobs=logprobs_to_wire(answer.logprobs),
            final=final_to_wire(answer.final),
            prompt_logprobs=logprobs_to_wire(answer.prompt_logprobs),
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
    health_servicer = DrainingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return health_servicer
