"""The HTTP front door: an OpenAI-compatible API (FastAPI, served by uvicorn on --http-port) over
the same request core as gRPC. Only this module (and convert.py for gRPC) maps the core's
vocabulary to and from a wire format.

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events ending in
`data: [DONE]`, or whole), GET /v1/models, vLLM's POST /tokenize and /detokenize, GET /health
(open, like gRPC's health service), and
the OpenAPI document at /openapi.json (and /docs). The token and the body's size are checked
before the body is read (router/http_guard.py). The request is read into the core's
RequestFields and checked by router/request.py, as gRPC's is; admission, the policy,
streaming, cancellation and metrics are the core's.

Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): 400 names the
parameter (unknown fields are refused, not ignored), 401 a missing or wrong bearer token, 404 an
unknown model, 429 admission's refusal with Retry-After (and retry-after-ms, which the openai
client honours), 503 a worker that failed under the request or no decode worker. A client that
closes its connection aborts the request on every worker it touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError
from engine.token_bytes import TextOffsets
from router.client_limit import ClientLimit, client_host
from router.core import RequestCore
from router.core_types import CoreChunk, Overloaded, Summary
from router.http_choices import Choices, choice_requests
from router.http_errors import ApiError, from_core, validation_error
from router.http_guard import Guard, unauthorized
from router.http_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    request_fields,
)
from router.http_shapes import Call, Shapes, prompt_only, sse, usage
from router.http_stream import EventStream, close, until_disconnected
from router.request import (
    ModelLimits,
    ParsedRequest,
    RequestFields,
    check_request,
    check_request_async,
    check_token_ids,
    off_loop_if_large,
    tokenized,
)
from router.security import bearer_matches
from router.vocab import Frontend

log = logging.getLogger("pdserve.http")
MAX_DETOKENIZE = 1 << 20  # ids /detokenize takes at once (about 0.1 s of decoding)
_BEARER = HTTPBearer(auto_error=False, description="the server's --auth-token-file")


class HttpApi:
    def __init__(
        self,
        core: RequestCore,
        tokenizer: Any,
        limits: ModelLimits,
        model: str,
        token: bytes | None = None,
        clients: ClientLimit | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.limits = limits
        self.model = model
        self._token = token
        self.clients = clients or ClientLimit(None, core.sink)  # --max-streams-per-client
        self.shapes = Shapes(model, tokenizer)
        self.api = self._build()
        self.app = Guard(self.api, token)  # the token and the body's size, before the body

    def _build(self) -> FastAPI:
        app = FastAPI(
            title="pdserve",
            summary="OpenAI-compatible completions over pdserve's prefill and decode pools",
            version="1",
            redoc_url=None,  # the description is open: /openapi.json and /docs, no more
            swagger_ui_oauth2_redirect_url=None,
        )

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
            return validation_error(exc).response()

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            code = "not_found" if exc.status_code == 404 else None
            if exc.status_code == 400:  # FastAPI could not read the body at all
                why = "could not be read as JSON (it must be UTF-8 JSON, not nested too deep)"
                return ApiError(400, f"body: {why}", param="body").response()
            return ApiError(exc.status_code, str(exc.detail), code=code).response()

        # Without a token the routes are open, and the OpenAPI document says no auth.
        auth = [Depends(self._authorize)] if self._token is not None else []

        @app.get("/health")
        async def health() -> JSONResponse:
            up = bool(self.core.backend.decode_ids)
            body = {"status": "ok" if up else "no decode worker"}
            return JSONResponse(body, status_code=200 if up else 503)

        app.head("/health", include_in_schema=False)(health)  # load balancers probe with HEAD

        @app.get("/v1/models", dependencies=auth)
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model:path}", dependencies=auth)
        async def model(model: str) -> dict[str, Any]:
            self._check_model(model)
            return self._model_card()

        @app.post("/v1/completions", dependencies=auth, response_model=None)
        async def completions(
            body: CompletionRequest, request: Request
        ) -> JSONResponse | StreamingResponse:
            return await self._serve(body, request, chat=False)

        @app.post("/v1/chat/completions", dependencies=auth, response_model=None)
        async def chat_completions(
            body: ChatCompletionRequest, request: Request
        ) -> JSONResponse | StreamingResponse:
            return await self._serve(body, request, chat=True)

        @app.post("/tokenize", dependencies=auth)
        async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
            self._check_model(body.model)
            fields, special = body.fields(), body.add_special_tokens is not False
            try:
                ids = await off_loop_if_large(
                    [fields], lambda: tokenized(fields, self.tokenizer, self.limits, special)
                )
            except InvalidRequestError as exc:
                raise from_core(exc) from None
            strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
            return {
                "count": len(ids),
                "max_model_len": self.limits.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }

        @app.post("/detokenize", dependencies=auth)
        async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
            self._check_model(body.model)
            try:
                if len(body.tokens) > MAX_DETOKENIZE:  # decoding holds the interpreter
                    why = f"has {len(body.tokens)} ids; at most {MAX_DETOKENIZE}"
                    raise InvalidRequestError("tokens", why)
                check_token_ids("tokens", body.tokens, self.limits)
            except InvalidRequestError as exc:
                raise from_core(exc) from None
            return {"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens)}

        return app

    async def _authorize(
        self, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
    ) -> None:
        """The token again, past the Guard (which checks it before the body is read): what
        puts the bearer scheme in the OpenAPI document."""
        given = f"Bearer {creds.credentials}" if creds is not None else ""
        if self._token is not None and not bearer_matches(given, self._token):
            raise unauthorized()

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": self.limits.max_model_len,
        }

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:  # none given: the one served
            raise ApiError(
                404,
                f"model: {model!r} is not served here; this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )

    # -- one request ---------------------------------------------------------------------------
    async def _serve(
        self, body: CompletionRequest | ChatCompletionRequest, request: Request, chat: bool
    ) -> JSONResponse | StreamingResponse:
        arrived = time.monotonic()
        self._check_model(body.model)
        renames: dict[str, str] = {}  # the core's field names as this request spells them
        try:
            batch, renames = request_fields(body)
            if len(batch) == 1:
                reqs = [await check_request_async(batch[0], self.tokenizer, self.limits)]
            else:
                reqs = await self._check_batch(batch, renames)
            total = len(reqs) * body.n
            self._check_choices(body.n, len(reqs))
            host = client_host(request.client.host if request.client else "")
            release = self.clients.take(host, Frontend.HTTP, total)
            if total > 1:  # room for all of them, or none is admitted (nor runs for nothing)
                try:
                    self.core.room_for(total, Frontend.HTTP)
                except Overloaded:
                    release()
                    raise
        except (InvalidRequestError, Overloaded) as exc:
            raise from_core(exc, renames) from None
        call = Call(
            tuple(reqs),
            body.n,
            arrived,
            chat,
            body.stream,
            bool(body.stream_options and body.stream_options.include_usage),
            int(time.time()),
            self._echoed(body, batch),
            isinstance(body, CompletionRequest) and body.echo_only,
        )
        # Admission and placement happen at the first chunk (of every choice): a refusal is
        # still an HTTP status, so a stream's headers go out with its first tokens. A whole
        # answer is collected under the same watch for a closed connection.
        choices = Choices(
            [self.core.generate(r, arrived) for q in reqs for r in choice_requests(q, body.n)],
            body.n,
        )
        work = choices.firsts() if call.stream else choices.answers()
        try:
            got = await until_disconnected(request.receive, work)
        except BaseException as exc:
            await close(choices, release)
            if isinstance(exc, (StopAsyncIteration, asyncio.CancelledError)):
                raise
            raise from_core(exc) from None
        if got is None or not call.stream:
            await close(choices, release)
        if got is None:  # the client left: the request was aborted on its workers
            return JSONResponse({}, status_code=499)
        if not call.stream:
            return JSONResponse(self.shapes.whole(call, [prompt_only(call, a) for a in got]))
        headers = {"Cache-Control": "no-cache", "X-Request-Id": call.req.request_id}
        return EventStream(self._events(call, choices.merged(got)), choices, release, headers)

    def _echoed(
        self, body: CompletionRequest | ChatCompletionRequest, batch: list[RequestFields]
    ) -> tuple[str, ...]:
        """A completion's `echo`: each prompt's text as given (token ids decoded, without
        special tokens, which count no text in the offsets)."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return ()
        return tuple(
            f.prompt
            if f.prompt is not None
            else self.tokenizer.decode(f.prompt_token_ids or [], skip_special_tokens=True)
            for f in batch
        )

    async def _check_batch(
        self, batch: list[RequestFields], renames: dict[str, str]
    ) -> list[ParsedRequest]:
        """Each prompt of a batch checked (an error names it: prompt[k]), on a thread where the
        prompts together are large enough to hold up the event loop."""

        def check_all() -> list[ParsedRequest]:
            out = []
            for k, fields in enumerate(batch):
                try:
                    out.append(check_request(fields, self.tokenizer, self.limits))
                except InvalidRequestError as exc:
                    at = f"prompt[{k}]"
                    if exc.field not in ("prompt", "prompt_token_ids"):  # max_tokens, ...
                        exc = InvalidRequestError(exc.field, f"{exc.message} ({at})")
                    named = {**renames, "prompt": at, "prompt_token_ids": at}
                    raise from_core(exc, named) from None
            return out

        return await off_loop_if_large(batch, check_all)

    def _check_choices(self, n: int, prompts: int = 1) -> None:
        """InvalidRequestError naming n (or the prompt, for a batch of prompts) where the
        choices could never all be admitted."""
        total = n * prompts
        for limit, flag, what in (
            (self.clients.limit, "--max-streams-per-client", "run per client"),
            (self.core.config.max_pending, "--max-pending", "wait for a first token at once"),
        ):
            if limit is not None and total > limit:
                many = f"{prompts} prompts of {n} choices" if prompts > 1 else f"{n} choices"
                why = f"{many}, each choice a request: at most {limit} {what}"
                raise InvalidRequestError("n" if prompts == 1 else "prompt", f"{why} ({flag})")

    async def _events(
        self, call: Call, chunks: AsyncGenerator[tuple[int, CoreChunk], None]
    ) -> AsyncIterator[str]:
        """The response's server-sent events, from the choices' first chunks on, then
        `[DONE]`. A failure mid-answer makes the last one before `[DONE]` an error event;
        EventStream closes the core's streams either way."""
        offsets: dict[int, TextOffsets] = {}
        finals: dict[int, Summary] = {}
        try:
            # Closed here however the reading ends: its tasks end before the streams close.
            async with contextlib.aclosing(chunks):
                async for i, chunk in chunks:
                    chunk = prompt_only(call, chunk)
                    for event in self._chunk_events(call, i, chunk, offsets):
                        yield event
                    if chunk.final is not None:
                        finals[i] = chunk.final
            if call.include_usage:
                summaries = [finals[i] for i in sorted(finals)]
                yield sse(self.shapes.chunk(call, None, usage_=usage(summaries, call.n)))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # a worker failed mid-answer: tell the client, then end
            yield sse(from_core(exc).body())
            yield "data: [DONE]\n\n"  # as after an answer: a reader waiting for it stops

    def _chunk_events(
        self, call: Call, i: int, chunk: CoreChunk, offsets: dict[int, TextOffsets]
    ) -> list[str]:
        """Choice i's chunk as events: a chat choice's first opens with its role. Tokens whose
        text is held back (a stop string may begin there) make no event of their own, unless
        they carry logprobs."""
        events = []
        echo = None  # the choice's first chunk, where the call echoes its prompt: choice i
        if i not in offsets:
            offsets[i] = self.shapes.offsets(call, i)
            echo = i if call.echoed else None
            if call.chat:
                delta = {"role": "assistant", "content": ""}
                opening = {"delta": delta, "logprobs": None, "finish_reason": None}
                events.append(sse(self.shapes.chunk(call, opening, index=i)))
        choice = self.shapes.streamed_choice(call, chunk, offsets[i], echo)
        said = chunk.text or echo is not None or chunk.final is not None
        if said or choice["logprobs"] is not None:
            events.append(sse(self.shapes.chunk(call, choice, chunk.final, index=i)))
        return events
