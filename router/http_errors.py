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
from router.core_types import Overloaded
from router.errors import failure_reason
from router.vocab import FailureReason

log = logging.getLogger("pdserve.http")
# The core's names for fields this API spells differently.
_PARAM = {"slo.ttft_ms": "pdserve.slo.ttft_ms", "slo.itl_ms": "pdserve.slo.itl_ms"}
# Pydantic names the union member it tried ("prompt.str"); the client's field is enough.
_PROMPT_SHAPE = (
    "must be text, a list of token ids (integers), or a list of either (a batch, all of one kind)"
)
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
    # From its parts: one a worker raised comes through Ray, whose str() is its traceback.
    return ApiError(400, f"{param}: {getattr(exc, 'message', exc)}", param=param)


# The status, the error's type and its code, by why the request failed (429 is built apart).
NO_WORKERS_RETRY_S = 5  # a 503 no_workers' Retry-After: a replaced worker takes seconds to come
_STATUS = {
    FailureReason.NO_WORKERS: (503, "service_unavailable", "no_workers"),
    FailureReason.WORKER_FAILED: (503, "service_unavailable", "worker_failed"),
    FailureReason.HANDOFF_FAILED: (503, "service_unavailable", "handoff_failed"),
    FailureReason.SHUTTING_DOWN: (503, "service_unavailable", "shutting_down"),
    FailureReason.INTERNAL: (500, "internal_error", "internal_error"),
}


def from_core(exc: BaseException, renames: dict[str, str] | None = None) -> ApiError:
    """What the core (or the request check) raised, as the HTTP error a client gets."""
    reason = failure_reason(exc)
    if isinstance(exc, InvalidRequestError):
        return invalid(exc, renames or {})
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
    status, type_, code = _STATUS[reason]
    if reason is FailureReason.INTERNAL:
        log.error("request failed", exc_info=exc)
        return ApiError(status, f"internal error: {type(exc).__name__}", type_=type_, code=code)
    log.warning("request failed: %s: %s", type(exc).__name__, exc)
    headers = None
    if reason is FailureReason.NO_WORKERS:  # one is being replaced, or the pools start
        headers = {"Retry-After": str(NO_WORKERS_RETRY_S)}
    return ApiError(status, str(exc), type_=type_, code=code, headers=headers)


def validation_error(exc: RequestValidationError) -> ApiError:
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    kind = err.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('msg')}", param=None)
    param = ""  # as the core names fields: messages[0].content
    for part in err.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and part not in _UNION_MEMBERS:
            param += f".{part}" if param else str(part)
    msg = str(err.get("msg", "invalid"))
    if not param and kind in ("dict_type", "model_attributes_type", "model_type"):
        msg = "must be a JSON object, sent as Content-Type: application/json"
    elif (
        kind not in ("extra_forbidden", "missing")
        and param.split("[")[0] == "prompt"
        and any(part in _UNION_MEMBERS for part in err.get("loc", ()))
    ):  # a completion's prompt, of one of its shapes (/tokenize's is text only)
        param, msg = "prompt", _PROMPT_SHAPE
    elif kind == "extra_forbidden":
        msg = "is not supported by pdserve"
    elif kind == "missing":
        msg = "is required"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        head, _, rest = msg.partition(": ")
        if rest and head.isidentifier():  # a check across fields names its own field
            param, msg = (f"{param}.{head}" if param else head), rest
    return ApiError(400, f"{param or 'body'}: {msg}", param=param or None)
