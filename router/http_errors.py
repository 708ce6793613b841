"""The HTTP API's errors, shaped as OpenAI's (`{"error": {"message", "type", "param", "code"}}`):
400 names the parameter, 401 a missing or wrong token, 404 an unknown model or route, 429 an
admission refusal (Retry-After, and retry-after-ms, which the openai client honours), 503 a worker
that failed or no decode worker, 500 only for a fault in pdserve itself."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from engine.errors import InvalidRequestError
from router.core_types import NoWorkers, Overloaded
from router.errors import HandoffFailed, WorkerLost, worker_failure

log = logging.getLogger("pdserve.http")
# The core's names for fields this API spells differently.
_PARAM = {"slo.ttft_ms": "pdserve.slo.ttft_ms", "slo.itl_ms": "pdserve.slo.itl_ms"}
# Pydantic names the union member it tried ("prompt.str"); the client's field is enough.
_UNION_MEMBERS = {"str", "int", "list[str]", "list[int]", "list[list[int]]", "list[TextPart]"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(exc: InvalidRequestError, renames: dict[str, str]) -> ApiError:
    param = renames.get(exc.field, _PARAM.get(exc.field, exc.field))
    message = str(exc)
    if param != exc.field:
        message = f"{param}:{message[len(exc.field) + 1 :]}"
    return ApiError(400, message, param=param)


def from_core(exc: BaseException) -> ApiError:
    """What the core raised before the first token, as the HTTP error a client gets."""
    if isinstance(exc, Overloaded):
        return ApiError(
            429,
            str(exc),
            type_="rate_limit_error",
            code=exc.reason.value,
            headers={
                "Retry-After": str(max(1, math.ceil(exc.retry_after_s))),
                "retry-after-ms": str(max(1, round(exc.retry_after_s * 1000))),
            },
        )
    if isinstance(exc, NoWorkers):
        return ApiError(503, str(exc), type_="service_unavailable", code="no_workers")
    if isinstance(exc, (WorkerLost, HandoffFailed)):
        return ApiError(503, str(exc), type_="service_unavailable", code="worker_failed")
    if worker_failure(exc):
        return ApiError(
            503, f"{type(exc).__name__}: {exc}", type_="service_unavailable", code="worker_failed"
        )
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", type_="internal_error")


def validation_error(exc: RequestValidationError) -> ApiError:
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    loc = [p for p in loc if p not in _UNION_MEMBERS]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('msg')}", param=None)
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid"))
    if kind == "extra_forbidden":
        msg = "is not supported by pdserve"
    elif kind == "missing":
        msg = "is required"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        if ": " in msg and param is None:  # a check across fields names its own field
            param, msg = msg.split(": ", 1)
    return ApiError(400, f"{param or 'body'}: {msg}", param=param)
