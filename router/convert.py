"""The gRPC edge's wire format, both ways: a pdserve.v1 GenerateRequest becomes the core's
RequestFields, which router/request.py checks field by field (as it does the HTTP API's; every
refusal is an InvalidRequestError naming the field, which the servicer turns into
INVALID_ARGUMENT), and the core's chunks and summaries become GenerateResponse, CompleteResponse
and FinalInfo. The only place that maps the core's vocabulary to and from protobuf values.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.token_logprobs import TokenLogprobs
from pdserve_proto import generation_pb2 as pb
from router.core_types import Summary
from router.request import ChatTurn, RequestFields
from router.vocab import FinishReason, Frontend, RoutePath

PATH_FROM_WIRE = {
    pb.PATH_AUTO: RoutePath.AUTO,
    pb.PATH_COLOCATED: RoutePath.COLOCATED,
    pb.PATH_DISAGGREGATED: RoutePath.DISAGGREGATED,
}
PATH_TO_WIRE = {path: wire for wire, path in PATH_FROM_WIRE.items()}


def request_fields(req: pb.GenerateRequest) -> RequestFields:
    """The request as router/request.py checks it (proto3's empty values: not given)."""
    if req.path not in PATH_FROM_WIRE:
        raise InvalidRequestError(
            "path", f"unknown value {req.path}; use PATH_AUTO, PATH_COLOCATED or PATH_DISAGGREGATED"
        )
    sp = req.sampling

    def opt(name: str) -> Any:
        return getattr(sp, name) if sp.HasField(name) else None

    return RequestFields(
        request_id=req.request_id or None,
        prompt=req.prompt or None,
        prompt_token_ids=list(req.prompt_token_ids) or None,
        messages=[
            ChatTurn(m.role, m.content, m.name if m.HasField("name") else None)
            for m in req.messages
        ]
        or None,
        add_generation_prompt=(
            req.add_generation_prompt if req.HasField("add_generation_prompt") else None
        ),
        continue_final_message=req.continue_final_message,
        max_tokens=opt("max_tokens"),
        temperature=opt("temperature"),
        top_p=opt("top_p"),
        top_k=opt("top_k"),
        min_p=opt("min_p"),
        seed=opt("seed"),
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=opt("logprobs"),
        prompt_logprobs=opt("prompt_logprobs"),
        presence_penalty=opt("presence_penalty"),
        frequency_penalty=opt("frequency_penalty"),
        repetition_penalty=opt("repetition_penalty"),
        logit_bias=dict(sp.logit_bias) or None,
        path=PATH_FROM_WIRE[req.path],
        slo_ttft_ms=req.slo.ttft_ms,
        slo_itl_ms=req.slo.itl_ms,
        frontend=Frontend.GRPC,
    )


FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def logprobs_to_wire(lps: tuple[TokenLogprobs, ...]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in lps
    ]


def final_to_wire(s: Summary) -> pb.FinalInfo:
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
                itl_p99_ms=p.itl_p99_s * 1000,
                prefill_worker=p.prefill_worker,
                decode_worker=p.decode_worker,
            )
            for p in s.decision.best
        ],
        decision_reason=s.decision.reason,
        kv_fallback=s.kv_fallback.value if s.kv_fallback is not None else "",
    )
    info.length_reason = s.length_reason or ""
    info.resumed = s.resumed
    if isinstance(s.stop_reason, str):
        info.stop_string = s.stop_reason
    elif isinstance(s.stop_reason, int):
        info.stop_token_id = s.stop_reason
    return info


# Where the string fields of a GenerateRequest sit on the wire (field number -> name), and the
# messages nested in it, so a request that protobuf refuses for bad UTF-8 can be answered with
# the field's name instead of a parse failure.
_STRINGS = {1: "request_id", 2: "prompt"}
_NESTED: dict[int, tuple[str, dict[int, str]]] = {
    4: ("messages", {1: "role", 2: "content", 3: "name"}),
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
