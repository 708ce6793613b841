"""The HTTP API's response bodies, shaped as OpenAI's: completions and chat completions, whole
or as stream chunks, with usage (prompt_tokens_details.cached_tokens) and logprobs, plus a
`pdserve` object that says what gRPC's FinalInfo says (the path taken, the workers, the TTFT)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

from engine.token_bytes import TextOffsets, TokenBytes
from engine.token_logprobs import TokenLogprobs
from router.core_types import Answer, CoreChunk, Summary
from router.request import ParsedRequest
from router.vocab import FinishReason

A = TypeVar("A", Answer, CoreChunk)


@dataclass(frozen=True, slots=True)
class Call:
    """One request as this module runs it."""

    # Its prompts (a completion may carry several), each with n choices: choice i is prompt
    # i // n's.
    prompts: tuple[ParsedRequest, ...]
    n: int
    arrived: float
    chat: bool
    stream: bool
    include_usage: bool
    created: int
    # A completion's `echo`: each prompt's text, put before its choices' (empty: no echo).
    echoed: tuple[str, ...] = ()
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, no completion token

    @property
    def req(self) -> ParsedRequest:
        """The first prompt's request: its id, sampling and limits are the answer's."""
        return self.prompts[0]

    def prompt(self, choice: int) -> ParsedRequest:
        return self.prompts[choice // self.n]


class Shapes:
    def __init__(self, model: str, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)

    def chunk(
        self,
        call: Call,
        choice: dict[str, Any] | None,
        final: Summary | None = None,
        usage_: dict[str, Any] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": response_id(call),
            "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created,
            "model": self.model,
            "choices": [] if choice is None else [{"index": index, **choice}],
        }
        if call.include_usage:
            out["usage"] = usage_
        if final is not None:
            out["pdserve"] = pdserve(final)
        return out

    def streamed_choice(
        self, call: Call, chunk: CoreChunk, offsets: TextOffsets, echo: int | None = None
    ) -> dict[str, Any]:
        """One chunk's choice; `offsets` carries the text offsets over the stream's chunks.
        `echo`: the choice whose first chunk this is, where the call echoes its prompt."""
        why = finish(chunk.final)
        echoed = None if echo is None else echo_of(call, echo, chunk.prompt_logprobs)
        text = chunk.text if echoed is None else echoed.text + chunk.text
        logprobs = self.logprobs(call, chunk.logprobs, offsets, echoed)
        # A choice's last chunk says what stopped it (a stop string or token; None: none did).
        end = {"stop_reason": chunk.final.stop_reason} if chunk.final is not None else {}
        if call.chat:
            delta = {"content": chunk.text} if chunk.text or chunk.final is None else {}
            return {"delta": delta, "logprobs": logprobs, "finish_reason": why, **end}
        return {"text": text, "logprobs": logprobs, "finish_reason": why, **end}

    def whole(self, call: Call, answers: list[Answer]) -> dict[str, Any]:
        """The whole answer: a choice per answer, each with what stopped it (stop_reason, as
        vLLM's) and how it was served (`pdserve`, as a stream's last chunk of it says); the
        answer's own `pdserve` says how the first was served."""
        choices = []
        for i, answer in enumerate(answers):
            echoed = echo_of(call, i, answer.prompt_logprobs) if call.echoed else None
            text = answer.text if echoed is None else echoed.text + answer.text
            logprobs = self.logprobs(call, answer.logprobs, self.offsets(call, i), echoed)
            if call.chat:
                said: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
            else:
                said = {"text": text}
            end = {"finish_reason": finish(answer.final), "stop_reason": answer.final.stop_reason}
            served = {"pdserve": pdserve(answer.final)}
            choices.append({"index": i, **said, "logprobs": logprobs, **end, **served})
        return {
            "id": response_id(call),
            "object": "chat.completion" if call.chat else "text_completion",
            "created": call.created,
            "model": self.model,
            "choices": choices,
            "usage": usage([a.final for a in answers], call.n),
            "pdserve": pdserve(answers[0].final),
        }

    def token(self, token_id: int) -> str:
        """A token's text in logprobs. One that holds part of a character is written as its
        bytes, "bytes:\\xf0\\x9f" (as OpenAI writes them): decoded, every such token would be
        the same U+FFFD, and completions' top_logprobs, keyed by text, would merge them."""
        if token_id in self.token_bytes.special:
            return str(self.tokenizer.decode([token_id]))
        raw = self.token_bytes(token_id)
        try:  # its bytes, not decode([id]): a SentencePiece token keeps its leading space
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def offsets(self, call: Call, choice: int = 0) -> TextOffsets:
        """A new answer's text offsets (completions' logprobs.text_offset), after its prompt:
        from the end of the text echoed, where the call echoes it."""
        start = len(call.echoed[choice // call.n]) if call.echoed else 0
        return TextOffsets(self.token_bytes, call.prompt(choice).prompt_token_ids, start)

    def logprobs(
        self,
        call: Call,
        lps: tuple[TokenLogprobs, ...],
        offsets: TextOffsets,
        echoed: Echo | None = None,
    ) -> dict[str, Any] | None:
        """The chunk's or answer's logprobs as the API gives them; an echoed prompt's go first,
        its first token's logprob null, and the completion's text offsets count from the end
        of the text echoed (the prompt's own are its tokens' bytes', which a tokenizer that
        writes a word's leading space as a mark may count one more than its text)."""
        if call.req.sampling.logprobs is None:
            return None
        if call.chat:

            def entry(tid: int, lp: float) -> dict[str, Any]:
                # The token's own bytes: part of a character where it holds part of one.
                return {
                    "token": self.token(tid),
                    "logprob": lp,
                    "bytes": list(self.token_bytes(tid)),
                }

            return {
                "content": [
                    {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(*t) for t in lp.top]}
                    for lp in lps
                ]
            }
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        if echoed is not None:
            ids, given, end = echoed.ids, echoed.logprobs, len(echoed.text)
            # None for the first token, and for any the answer lacks (it ended before one).
            plps = [None, *given][: len(ids)] + [None] * (len(ids) - 1 - len(given))
            out["tokens"] = [self.token(t) for t in ids]
            out["token_logprobs"] = [lp and lp.logprob for lp in plps]
            out["top_logprobs"] = [lp and self._top(lp) for lp in plps]
            prompt_offsets = TextOffsets(self.token_bytes).feed(ids)
            out["text_offset"] = [min(o, end) for o in prompt_offsets]
        out["tokens"] += [self.token(lp.token_id) for lp in lps]
        out["token_logprobs"] += [lp.logprob for lp in lps]
        out["top_logprobs"] += [self._top(lp) for lp in lps]
        out["text_offset"] += offsets.feed(lp.token_id for lp in lps)
        return out

    def _top(self, lp: TokenLogprobs) -> dict[str, float]:
        """A completion token's alternatives, and the sampled token among them always (OpenAI's
        and vLLM's: up to logprobs + 1 entries; with logprobs 0, the sampled token alone)."""
        top: dict[str, float] = {}
        for t, v in lp.top:  # best first: two tokens of one text (rare) keep the better's
            top.setdefault(self.token(t), v)
        top[self.token(lp.token_id)] = lp.logprob  # its own, as `token_logprobs` gives it
        return top


class Echo(NamedTuple):
    """A choice's echoed prompt: its text, token ids and logprobs (one per token after the
    first; none where not asked for)."""

    text: str
    ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]


def echo_of(call: Call, choice: int, logprobs: tuple[TokenLogprobs, ...]) -> Echo:
    return Echo(call.echoed[choice // call.n], call.prompt(choice).prompt_token_ids, logprobs)


FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def prompt_only(call: Call, x: A) -> A:
    """An answer or chunk of an echo with max_tokens 0 (`call.echo_only`): without the token
    run for it, its finish `length` (the prompt's KV computed, no token given), as vLLM's."""
    if not call.echo_only:
        return x
    final = x.final
    if final is not None and final.finish_reason is not FinishReason.ABORT:
        final = replace(final, completion_tokens=0, finish_reason=FinishReason.LENGTH,
                        stop_reason=None)  # fmt: skip
    return replace(x, token_ids=(), text="", logprobs=(), final=final)


def finish(final: Summary | None) -> str | None:
    if final is None or final.finish_reason is None:
        return None
    return FINISH[final.finish_reason]


def usage(finals: list[Summary], n: int = 1) -> dict[str, Any]:
    """A request's usage over its choices, `n` per prompt: each prompt once (its cache hits
    its first choice's), the completion tokens of all."""
    firsts = finals[::n]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_prompt_tokens for s in firsts)},
    }


def pdserve(s: Summary) -> dict[str, Any]:
    """What gRPC's FinalInfo says beside the text: the path taken, the workers, the TTFT."""
    return {
        "path": s.path.value,
        "prefill_worker": s.prefill_worker or None,  # None: colocated (no prefill worker)
        "decode_worker": s.decode_worker,
        "ttft_ms": s.ttft_s * 1000,
        "decision_reason": s.decision.reason,
        "kv_fallback": s.kv_fallback.value if s.kv_fallback is not None else None,
        "stop_reason": s.stop_reason,
        "length_reason": s.length_reason,
        "resumed": s.resumed,
    }


def response_id(call: Call) -> str:
    return ("chatcmpl-" if call.chat else "cmpl-") + call.req.request_id


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
