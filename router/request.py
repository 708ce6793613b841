"""A request as the core takes it, and the one place it is checked. Each front door (gRPC in
router/convert.py, HTTP in router/http_api.py) reads its wire format into RequestFields, and
`check_request` turns those into a ParsedRequest or refuses them with an InvalidRequestError that
names the field and what is allowed; nothing is clamped. A front door may rename the field for
its own clients (the HTTP API's `max_completion_tokens`), never re-check it.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from engine.chat_template import chat_token_ids
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.vocab import Frontend, RoutePath

MAX_REQUEST_ID = 256  # characters: a client's id goes into logs and every worker's books
CHAT_ROLES = ("system", "developer", "user", "assistant")
# OpenAI's newer name for the system message: the chat templates know it as system.
_ROLE_AS = {"developer": "system"}
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0


class ChatTurn(NamedTuple):
    """One chat message as a front door read it."""

    role: str
    content: str
    name: str | None = None  # the participant's, passed to the template (most leave it out)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_prompt_bytes: int = 1 << 20  # text (or chat) prompts larger than this are refused
    max_tokens: int | None = None  # the server's cap on one request's max_tokens (None: none)
    # The KV cache of the smallest worker, in blocks of `block_size` tokens (0: not checked): a
    # prompt it cannot hold could run nowhere.
    kv_blocks: int = 0
    block_size: int = 0


@dataclass(frozen=True, slots=True)
class RequestFields:
    """A request as a front door read it, before any check. None: not given (the default)."""

    frontend: Frontend  # every door says which it is: its requests' metrics carry it
    request_id: str | None = None
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    messages: Sequence[ChatTurn] | None = None
    # With messages: open the assistant's turn (None: unless continue_final_message), or leave
    # the last message open for the model to go on with.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when max_tokens is None (capped by the room)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's only)
    prompt_logprobs: int | None = None  # the same for each prompt token (colocated path)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None  # token id -> bias
    path: RoutePath = RoutePath.AUTO
    slo_ttft_ms: float | None = None  # None or 0: the server's default
    slo_itl_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    path: RoutePath
    slo_ttft_ms: float | None  # None: the server's default
    slo_itl_ms: float | None
    frontend: Frontend

    def asks_prompt_logprobs(self, emitted: int) -> bool:
        """Whether a placement of it after `emitted` tokens asks for its prompt's logprobs:
        they come with its first token, so a resume after one does not."""
        return self.sampling.prompt_logprobs is not None and not emitted


# Why a request asking for prompt logprobs is refused a handoff (the router's check of a path
# the client names, and Cluster.generate's of a placement).
PROMPT_LOGPROBS_COLOCATED = (
    "are computed where the prompt is prefilled, on the colocated path: not on a handoff "
    "(path disaggregated)"
)


def prompt_bytes(f: RequestFields) -> int:
    """The text a request brings (its prompt or chat turns), in characters: large ones are worth
    tokenizing off the event loop."""
    return len(f.prompt or "") + sum(len(m.content) + len(m.name or "") for m in f.messages or ())


def check_request(f: RequestFields, tokenizer: Any, limits: ModelLimits) -> ParsedRequest:
    ids = _prompt_ids(f, tokenizer, limits)
    sampling = _sampling(f, len(ids), limits)
    for name, value in (("slo.ttft_ms", f.slo_ttft_ms), ("slo.itl_ms", f.slo_itl_ms)):
        if value is not None and not 0 <= value < math.inf:
            raise InvalidRequestError(name, f"must be finite and >= 0 (0: default), got {value}")
    if f.request_id is not None and len(f.request_id) > MAX_REQUEST_ID:
        raise InvalidRequestError(
            "request_id", f"has {len(f.request_id)} characters; at most {MAX_REQUEST_ID}"
        )
    if f.request_id is not None and not f.request_id.isprintable():
        # It is logged as given: a newline in it would forge a log line.
        raise InvalidRequestError("request_id", "must hold printable characters only")
    if sampling.prompt_logprobs is not None and f.path is RoutePath.DISAGGREGATED:
        raise InvalidRequestError("prompt_logprobs", PROMPT_LOGPROBS_COLOCATED)
    return ParsedRequest(
        request_id=f.request_id or f"req-{uuid.uuid4().hex[:16]}",
        prompt_token_ids=tuple(ids),
        sampling=sampling,
        path=f.path,
        slo_ttft_ms=f.slo_ttft_ms or None,
        slo_itl_ms=f.slo_itl_ms or None,
        frontend=f.frontend,
    )


def _prompt_ids(f: RequestFields, tokenizer: Any, limits: ModelLimits) -> list[int]:
    given = [f.prompt is not None, f.prompt_token_ids is not None, f.messages is not None]
    if sum(given) != 1:
        raise InvalidRequestError(
            "prompt", "give exactly one of prompt, prompt_token_ids or messages (non-empty)"
        )
    if f.prompt_token_ids is not None:
        _chat_options_need_messages(f)
        if len(f.prompt_token_ids) >= limits.max_model_len:  # before looking at each id
            raise InvalidRequestError(
                "prompt_token_ids",
                f"has {len(f.prompt_token_ids)} tokens; at most {limits.max_model_len - 1} "
                f"(the model's context is {limits.max_model_len})",
            )
        ids = list(f.prompt_token_ids)
        check_token_ids("prompt_token_ids", ids, limits)
    else:
        ids = tokenized(f, tokenizer, limits)
    if not ids:
        raise InvalidRequestError("prompt", "must not be empty (at least 1 token)")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"has {len(ids)} tokens; at most {limits.max_model_len - 1} "
            f"(the model's context is {limits.max_model_len})",
        )
    if limits.kv_blocks:
        most = limits.kv_blocks * limits.block_size - 1  # its first token's slot too
        if len(ids) > most:
            raise InvalidRequestError(
                "prompt",
                f"has {len(ids)} tokens; the workers' KV cache holds at most {most} beside "
                f"its first output token ({limits.kv_blocks} block"
                f"{'' if limits.kv_blocks == 1 else 's'} of {limits.block_size} tokens; "
                "--kv-cache-gib sizes it on a CPU)",
            )
    return ids


def tokenized(
    f: RequestFields, tokenizer: Any, limits: ModelLimits, special_tokens: bool = True
) -> list[int]:
    """A text prompt's or chat's token ids as a request of it would get them, with the same
    checks of its fields and size but none of its length (/tokenize counts the tokens; it may
    leave a prompt's special tokens out)."""
    if (f.prompt is None) == (f.messages is None):
        raise InvalidRequestError("prompt", "give exactly one of prompt or messages")
    _chat_options_need_messages(f)
    if f.prompt is not None:
        _check_size("prompt", utf8_len("prompt", f.prompt), limits)
        return encode(tokenizer, f.prompt, special_tokens)
    return _chat_ids(f, tokenizer, limits)


def check_token_ids(field: str, ids: Sequence[int], limits: ModelLimits) -> None:
    """InvalidRequestError naming `field` where an id is outside the vocabulary."""
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(field, f"token id {bad} is outside [0, {limits.vocab_size})")


def _chat_options_need_messages(f: RequestFields) -> None:
    if f.messages is None and (f.continue_final_message or f.add_generation_prompt is not None):
        field = "continue_final_message" if f.continue_final_message else "add_generation_prompt"
        raise InvalidRequestError(field, "only with messages (the chat template's option)")


def _chat_ids(f: RequestFields, tokenizer: Any, limits: ModelLimits) -> list[int]:
    messages = f.messages or ()
    if not messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    size = 0
    chat: list[dict[str, str]] = []
    for i, (role, content, name) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role", f"must be one of {CHAT_ROLES}, got {role!r}"
            )
        size += utf8_len(f"messages[{i}].content", content)
        chat.append({"role": _ROLE_AS.get(role, role), "content": content})
        if name is not None:
            size += utf8_len(f"messages[{i}].name", name)
            chat[-1]["name"] = name
    _check_size("messages", size, limits)
    if f.continue_final_message and f.add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message",
            "cannot be true with add_generation_prompt true (the last message is left open, "
            "no new turn opened)",
        )
    opening = (
        not f.continue_final_message if f.add_generation_prompt is None else f.add_generation_prompt
    )
    return chat_token_ids(tokenizer, chat, "messages", opening, f.continue_final_message)


def encode(tokenizer: Any, text: str, special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, through the Rust tokenizer directly when there is one: the same
    ids (special tokens included, unless `special_tokens` is false) without the Python wrapper's
    per-call cost."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=special_tokens).ids)
    return list(tokenizer.encode(text, add_special_tokens=special_tokens))


def utf8_len(field: str, text: str) -> int:
    """Its length in UTF-8; a lone surrogate (JSON allows "\\ud800") cannot be encoded."""
    try:
        return len(text.encode())
    except UnicodeEncodeError:
        raise InvalidRequestError(field, "is not valid UTF-8 (a lone surrogate)") from None


def _check_size(field: str, nbytes: int, limits: ModelLimits) -> None:
    if nbytes > limits.max_prompt_bytes:
        raise InvalidRequestError(
            field, f"is {nbytes} bytes; at most {limits.max_prompt_bytes} bytes are accepted"
        )


def max_tokens_for(
    asked: int | None, default: int, prompt_len: int, max_model_len: int, limit: int | None = None
) -> int:
    """A request's max_tokens: `default` cut to what the context leaves (and to `limit`, the
    server's --max-tokens-limit) where none was asked for; one asked for past them is refused,
    naming the field (the server's check, and `pdserve generate`'s)."""
    room = max_model_len - prompt_len
    cap = room if limit is None else min(room, limit)
    if asked is None:
        return min(default, cap)
    if not 1 <= asked <= cap:
        why = f"(context {max_model_len})"
        if cap < room:
            why = f"(the server's --max-tokens-limit {limit})"
        raise InvalidRequestError(
            "max_tokens",
            f"must be in [1, {cap}] for a {prompt_len}-token prompt {why}, got {asked}",
        )
    return asked


def _sampling(f: RequestFields, prompt_len: int, limits: ModelLimits) -> SamplingParams:
    max_tokens = max_tokens_for(
        f.max_tokens, f.default_max_tokens, prompt_len, limits.max_model_len, limits.max_tokens
    )
    for i, stop in enumerate(f.stop):
        utf8_len(f"stop[{i}]", stop)
    for name, ids in (("stop_token_ids", f.stop_token_ids), ("logit_bias", f.logit_bias or ())):
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(name, f"token id {bad} is outside [0, {limits.vocab_size})")
    # SamplingParams checks every range itself and names the field.
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if f.temperature is None else f.temperature,
        top_p=1.0 if f.top_p is None else f.top_p,
        top_k=0 if f.top_k is None else f.top_k,
        min_p=0.0 if f.min_p is None else f.min_p,
        seed=f.seed,
        stop=tuple(f.stop),
        stop_token_ids=tuple(f.stop_token_ids),
        ignore_eos=f.ignore_eos,
        logprobs=f.logprobs,
        prompt_logprobs=f.prompt_logprobs,
        presence_penalty=f.presence_penalty or 0.0,
        frequency_penalty=f.frequency_penalty or 0.0,
        repetition_penalty=1.0 if f.repetition_penalty is None else f.repetition_penalty,
        logit_bias=tuple(sorted((f.logit_bias or {}).items())),
    )


# Prompts larger than this are tokenized on a thread, so the event loop keeps serving.
TOKENIZE_INLINE_CHARS = 16 << 10
T = TypeVar("T")


async def check_request_async(
    f: RequestFields, tokenizer: Any, limits: ModelLimits
) -> ParsedRequest:
    """check_request, on a thread when the prompt is large enough to hold up the event loop."""
    return await off_loop_if_large([f], lambda: check_request(f, tokenizer, limits))


async def off_loop_if_large(fields: Sequence[RequestFields], check: Callable[[], T]) -> T:
    """`check` (of the requests `fields`), on a thread where their prompts together are large
    enough to hold up the event loop (TOKENIZE_INLINE_CHARS), else at once."""
    if sum(prompt_bytes(f) for f in fields) > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(check)
    return check()
