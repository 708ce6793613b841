"""The gRPC edge: a pdserve.v1 GenerateRequest becomes the router's typed request, checked field by
field. Every refusal is an InvalidRequestError naming the field and what is allowed, which the
servicer turns into INVALID_ARGUMENT; nothing is clamped.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from pdserve_proto import generation_pb2 as pb
from router.vocab import RoutePath

CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0


PATH_FROM_WIRE = {
    pb.PATH_AUTO: RoutePath.AUTO,
    pb.PATH_COLOCATED: RoutePath.COLOCATED,
    pb.PATH_DISAGGREGATED: RoutePath.DISAGGREGATED,
}
PATH_TO_WIRE = {path: wire for wire, path in PATH_FROM_WIRE.items()}


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_prompt_bytes: int = 1 << 20  # text (or chat) prompts larger than this are refused
    max_tokens: int | None = None  # the server's cap on one request's max_tokens (None: none)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    path: RoutePath
    slo_ttft_ms: float | None  # None: the server's default
    slo_itl_ms: float | None


def parse_request(req: pb.GenerateRequest, tokenizer: Any, limits: ModelLimits) -> ParsedRequest:
    ids = _prompt_ids(req, tokenizer, limits)
    sampling = _sampling(req.sampling, len(ids), limits)
    if req.path not in PATH_FROM_WIRE:
        raise InvalidRequestError(
            "path", f"unknown value {req.path}; use PATH_AUTO, PATH_COLOCATED or PATH_DISAGGREGATED"
        )
    for name in ("ttft_ms", "itl_ms"):
        value = getattr(req.slo, name)
        if not 0 <= value < math.inf:
            raise InvalidRequestError(
                f"slo.{name}", f"must be finite and >= 0 (0: default), got {value}"
            )
    return ParsedRequest(
        request_id=req.request_id or f"req-{uuid.uuid4().hex[:16]}",
        prompt_token_ids=tuple(ids),
        sampling=sampling,
        path=PATH_FROM_WIRE[req.path],
        slo_ttft_ms=req.slo.ttft_ms or None,
        slo_itl_ms=req.slo.itl_ms or None,
    )


def _prompt_ids(req: pb.GenerateRequest, tokenizer: Any, limits: ModelLimits) -> list[int]:
    given = [bool(req.prompt), bool(req.prompt_token_ids), bool(req.messages)]
    if sum(given) != 1:
        raise InvalidRequestError(
            "prompt", "give exactly one of prompt, prompt_token_ids or messages (non-empty)"
        )
    if req.prompt_token_ids:
        if len(req.prompt_token_ids) >= limits.max_model_len:  # before looking at each id
            raise InvalidRequestError(
                "prompt_token_ids",
                f"has {len(req.prompt_token_ids)} tokens; at most {limits.max_model_len - 1} "
                f"(the model's context is {limits.max_model_len})",
            )
        ids = list(req.prompt_token_ids)
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt_token_ids", f"token id {bad} is outside [0, {limits.vocab_size})"
            )
    elif req.prompt:
        _check_size("prompt", len(req.prompt.encode()), limits)
        ids = encode(tokenizer, req.prompt)
    else:
        size = 0
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role", f"must be one of {CHAT_ROLES}, got {m.role!r}"
                )
            size += len(m.content.encode())
        _check_size("messages", size, limits)
        chat = [{"role": m.role, "content": m.content} for m in req.messages]
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template; send prompt")
        try:
            ids = list(
                tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        except Exception as exc:  # the template's own refusal (e.g. roles out of order)
            raise InvalidRequestError("messages", f"the chat template refused them: {exc}") from exc
    if not ids:
        raise InvalidRequestError("prompt", "must not be empty (at least 1 token)")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"has {len(ids)} tokens; at most {limits.max_model_len - 1} "
            f"(the model's context is {limits.max_model_len})",
        )
    return ids


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text)`, through the Rust tokenizer directly when there is one: the same
    ids (special tokens included) without the Python wrapper's per-call cost."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text).ids)
    return list(tokenizer.encode(text))


def _check_size(field: str, nbytes: int, limits: ModelLimits) -> None:
    if nbytes > limits.max_prompt_bytes:
        raise InvalidRequestError(
            field, f"is {nbytes} bytes; at most {limits.max_prompt_bytes} bytes are accepted"
        )


def _sampling(sp: pb.SamplingParams, prompt_len: int, limits: ModelLimits) -> SamplingParams:
    room = limits.max_model_len - prompt_len
    cap = room if limits.max_tokens is None else min(room, limits.max_tokens)
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, cap)
    if sp.HasField("max_tokens") and not 1 <= max_tokens <= cap:
        why = f"(context {limits.max_model_len})"
        if cap < room:
            why = f"(the server's --max-tokens-limit {limits.max_tokens})"
        raise InvalidRequestError(
            "max_tokens",
            f"must be in [1, {cap}] for a {prompt_len}-token prompt {why}, got {max_tokens}",
        )
    bad_stop = next((t for t in sp.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError(
            "stop_token_ids", f"token id {bad_stop} is outside [0, {limits.vocab_size})"
        )
    # SamplingParams checks every range itself and names the field.
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sp.temperature if sp.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k if sp.HasField("top_k") else 0,
        min_p=sp.min_p if sp.HasField("min_p") else 0.0,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
    )


# Where the string fields of a GenerateRequest sit on the wire (field number -> name), and the
# messages nested in it, so a request that protobuf refuses for bad UTF-8 can be answered with
# the field's name instead of a parse failure.
_STRINGS = {1: "request_id", 2: "prompt"}
_NESTED: dict[int, tuple[str, dict[int, str]]] = {
    4: ("messages", {1: "role", 2: "content"}),
    5: ("sampling", {7: "stop"}),
}


def invalid_utf8_field(raw: bytes) -> str | None:
    """The first string field of a serialized GenerateRequest that is not valid UTF-8 (e.g.
    "sampling.stop[0]"), or None. Malformed wire data in general is not this function's job."""
    counts: dict[str, int] = {}
    for num, value in _fields(raw):
        if num in _STRINGS and not _utf8(value):
            return _STRINGS[num]
        if num in _NESTED:
            name, strings = _NESTED[num]
            i = counts.get(name, 0)
            counts[name] = i + 1
            inner: dict[str, int] = {}
            for sub, sval in _fields(value):
                if sub in strings:
                    j = inner.get(strings[sub], 0)
                    inner[strings[sub]] = j + 1
                    if not _utf8(sval):
                        index = f"[{i}]" if name == "messages" else ""
                        sub_index = f"[{j}]" if strings[sub] == "stop" else ""
                        return f"{name}{index}.{strings[sub]}{sub_index}"
    return None


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, bytes]]:
    """(field number, payload) of each length-delimited field; other wire types are skipped."""
    out: list[tuple[int, bytes]] = []
    i = 0
    try:
        while i < len(buf):
            key, i = _varint(buf, i)
            num, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(buf, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                n, i = _varint(buf, i)
                out.append((num, buf[i : i + n]))
                i += n
            else:
                break
    except ValueError:
        pass
    return out
