"""The HTTP API's request bodies (pydantic models, from which FastAPI writes /openapi.json), and
how one becomes the core's RequestFields. Like router/convert.py for gRPC, this reads the wire
format and checks only its shape; router/request.py checks the values, for both doors.

Unknown fields are refused (extra="forbid"), never ignored, and so are values of the wrong type
(strict: "5" is not an integer, 1 not a boolean). A field set to null is taken as not given, as
OpenAI takes it. OpenAI fields pdserve does not implement are accepted at the value that asks
for nothing (`best_of: 1`, `store: false`, ...; NOOP) and refused at any other.
Defaults follow OpenAI's: a completion's max_tokens is 16, a chat's is the server's own.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.errors import InvalidRequestError
from router.request import CHAT_ROLES, DEFAULT_MAX_TOKENS, ChatTurn, RequestFields
from router.vocab import Frontend, RoutePath

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the server's own)
MAX_CHOICES = 16  # n: each choice is a request of its own (router/http_choices.py)
MAX_PROMPTS = 256  # a completion's batch of prompts, each with its n choices


# OpenAI's fields that pdserve does not implement, at the value that asks for nothing: clients
# that send them at that value (LangChain, LiteLLM, agent SDKs) are served. `user` is only a
# label for the caller's own monitoring.
NOOP: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "store": (False,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "metadata": ({},),
    "response_format": ({"type": "text"},),
}


class _Body(BaseModel):
    # A field pdserve does not support is refused; so is a value of the wrong type.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """A known field set to null takes its default (OpenAI's reading of null)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class SloHint(_Body):
    ttft_ms: float | None = Field(None, description="TTFT SLO, ms (0 or absent: the server's)")
    itl_ms: float | None = Field(None, description="ITL SLO, ms (0 or absent: the server's)")


class PdserveOptions(_Body):
    """pdserve's own request options: the path and SLO hints."""

    path: Literal["auto", "colocated", "disaggregated"] = "auto"
    slo: SloHint | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = Field(None, description="the served model's name (default: it)")
    max_tokens: int | None = None
    # Only OpenAI's own rules are checked here (temperature up to 2, n 1); every range the
    # engine has is checked by router/request.py, for both doors, naming the field.
    temperature: float | None = Field(None, le=2, allow_inf_nan=False, description="0 to 2")
    top_p: float | None = Field(None, allow_inf_nan=False, description="in (0, 1]")
    seed: int | None = Field(None, description="in [0, 2**64); -1 as absent (random)")
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description=f"choices to generate, 1 to {MAX_CHOICES}")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, allow_inf_nan=False, description="-2 to 2, per token in the output"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, allow_inf_nan=False, description="-2 to 2, per occurrence in the output"
    )
    # vLLM's extensions
    top_k: int | None = Field(None, description="-1 or 0: off")
    min_p: float | None = Field(None, allow_inf_nan=False, description="in [0, 1]")
    repetition_penalty: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="> 0 (1: off), prompt and output tokens"
    )
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    pdserve: PdserveOptions | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]"
    )
    # OpenAI's, at the value that asks for nothing only (NOOP); `user` is taken and left.
    user: str | None = None
    store: bool = Field(False, description="only false")
    metadata: dict[str, str] = Field(default_factory=dict, description="only {}")

    @field_validator(*NOOP, check_fields=False)
    @classmethod
    def _noop(cls, v: Any, info: Any) -> Any:
        allowed = NOOP[info.field_name]
        if v not in allowed:
            shown = " or ".join(json.dumps(a) for a in allowed)
            raise ValueError(f"only {shown} is supported, got {json.dumps(v)}")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text or token ids, or a list of several (a batch: n choices each, the "
        "choices of prompt k at indices k*n to k*n+n-1)"
    )
    logprobs: int | None = Field(None, description="top alternatives per token, 0 to 20")
    echo: bool = Field(
        False,
        description="the prompt's text before the completion's; with logprobs, the prompt's "
        "tokens and their logprobs before the completion's (the first token's null; computed "
        "on the colocated path); with max_tokens 0, the prompt alone",
    )
    best_of: int = Field(1, description="only 1")
    suffix: str = Field("", description='only ""')

    @property
    def echo_only(self) -> bool:
        """`echo` with max_tokens 0: the prompt alone (vLLM's reading), no completion."""
        return self.echo and self.max_tokens == 0

    @model_validator(mode="after")
    def _best_of_n(self) -> CompletionRequest:
        # OpenAI's rule: best_of candidates, of which the n best are returned.
        if "best_of" in self.model_fields_set and self.best_of < self.n:
            raise ValueError(f"best_of: must be at least n ({self.n}), got {self.best_of}")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str = Field(description="system, developer (as system), user or assistant")
    content: str | list[TextPart]
    name: str | None = Field(
        None, description="the participant's, passed to the chat template (most leave it out)"
    )

    @model_validator(mode="before")
    @classmethod
    def _role_first(cls, data: Any) -> Any:
        """A role pdserve does not take is named before the fields that come with it (a tool
        message's tool_call_id)."""
        role = data.get("role") if isinstance(data, dict) else None
        if isinstance(role, str) and role not in CHAT_ROLES:
            raise ValueError(f"role: must be one of {CHAT_ROLES}, got {role!r}")
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, part in enumerate(v):
                if not isinstance(part, dict):
                    raise ValueError(
                        f'part {i}: must be an object, {{"type": "text", "text": ...}}, '
                        f"got {json.dumps(part)[:40]}"
                    )
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(
                        f"part {i}: only text parts are supported, got type {json.dumps(kind)}"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f'part {i}: needs "text", a string')
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    # OpenAI's newer name for max_tokens; where a client sends both, it wins (as vLLM's).
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description="0 to 20; needs logprobs: true")
    tools: list[Any] = Field(default_factory=list, description="only []")
    tool_choice: str = Field("none", description='only "none"')
    parallel_tool_calls: bool | None = Field(None, description="no tools: either asks nothing")
    response_format: dict[str, Any] = Field(
        default_factory=lambda: {"type": "text"}, description='only {"type": "text"}'
    )
    # vLLM's chat-template options.
    add_generation_prompt: bool | None = Field(
        None, description="open the assistant's turn (default: unless continue_final_message)"
    )
    continue_final_message: bool = Field(
        False, description="leave the last message (usually the assistant's) open to go on with"
    )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self


class TokenizeRequest(_Body):
    """vLLM's /tokenize: the token ids a completion of `prompt`, or a chat of `messages`,
    would get (the same tokenizer and chat template), and their count."""

    model: str | None = None
    prompt: str | None = Field(None, description="text (or messages)")
    messages: list[ChatMessage] | None = Field(None, description="a chat (or prompt)")
    add_generation_prompt: bool | None = Field(
        None, description="with messages: open the assistant's turn (default: unless continuing)"
    )
    continue_final_message: bool = Field(
        False, description="with messages: leave the last message open to go on with"
    )
    add_special_tokens: bool | None = Field(
        None,
        description="with prompt: its special tokens (a BOS) as a completion gets them (default "
        "true); with messages only false (the chat template writes them)",
    )
    return_token_strs: bool = Field(False, description="each token's own string too")

    @model_validator(mode="after")
    def _special_tokens_of_a_chat(self) -> TokenizeRequest:
        if self.messages is not None and self.add_special_tokens:
            raise ValueError(
                "add_special_tokens: only false with messages (the chat template writes them)"
            )
        return self

    def fields(self) -> RequestFields:
        messages = None
        if self.messages is not None:
            messages = [ChatTurn(m.role, _text(m.content), m.name) for m in self.messages]
        return RequestFields(
            prompt=self.prompt,
            messages=messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            frontend=Frontend.HTTP,
        )


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: the text of token ids."""

    model: str | None = None
    tokens: list[int]


def request_fields(
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[list[RequestFields], dict[str, str]]:
    """The body as the core's RequestFields, one per prompt (a completion's list of prompts:
    `<id>-p<k>` the id of prompt k > 0), and the core's field names this API spells otherwise
    for this request."""
    renames: dict[str, str] = {}
    prompt: str | None = None
    ids: list[int] | None = None
    messages: list[ChatTurn] | None = None
    logprobs: int | None
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's too
    max_tokens = body.max_tokens
    default_max_tokens = DEFAULT_MAX_TOKENS
    chat_options: dict[str, Any] = {}
    prompts: list[tuple[str | None, list[int] | None]] = []
    if isinstance(body, CompletionRequest):
        prompts = _prompts(body.prompt)
        prompt, ids = prompts[0]
        if ids is not None:
            renames["prompt_token_ids"] = "prompt"
        logprobs = body.logprobs
        if body.echo:
            prompt_logprobs = logprobs
            renames["prompt_logprobs"] = "echo"
            if body.echo_only:  # one token run, none given
                max_tokens = 1
        default_max_tokens = COMPLETIONS_MAX_TOKENS
    else:
        messages = [ChatTurn(m.role, _text(m.content), m.name) for m in body.messages]
        renames["prompt"] = "messages"  # the prompt the chat template makes of them
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None:
            renames["logprobs"] = "top_logprobs"
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        chat_options = {
            "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
        }
    opts = body.pdserve or PdserveOptions()
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    fields = RequestFields(
        request_id=f"http-{uuid.uuid4().hex[:16]}",
        prompt=prompt,
        prompt_token_ids=ids,
        messages=messages,
        **chat_options,
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,  # -1 is no seed (SamplingParams, for both doors)
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_token_biases(body.logit_bias),
        path=RoutePath(opts.path),
        slo_ttft_ms=opts.slo.ttft_ms if opts.slo else None,
        slo_itl_ms=opts.slo.itl_ms if opts.slo else None,
        frontend=Frontend.HTTP,
    )
    if len(prompts) < 2:
        return [fields], renames
    rid = fields.request_id
    return [
        replace(fields, prompt=p, prompt_token_ids=ids, request_id=f"{rid}-p{k}" if k else rid)
        for k, (p, ids) in enumerate(prompts)
    ], renames


def _token_biases(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, whose keys are token ids written as strings."""
    if not bias:
        return None
    # A token id has at most 10 digits (int32; the vocabulary's range is checked later); int()
    # refuses strings of over 4300 digits with its own error.
    bad = next((k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 10)), None)
    if bad is not None:
        shown = bad if len(bad) <= 40 else f"{bad[:20]}...({len(bad)} characters)"
        raise InvalidRequestError("logit_bias", f"keys must be token ids, got {shown!r}")
    return {int(k): v for k, v in bias.items()}


def _prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
) -> list[tuple[str | None, list[int] | None]]:
    """A completion's prompts, each its text or its token ids."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [(None, [int(p) for p in prompt])]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError(
            "prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}"
        )
    return [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]  # type: ignore[arg-type]


def _text(content: str | list[TextPart]) -> str:
    """A message's text: its text parts joined by newlines (as vLLM joins them)."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)
