"""Turns a request's new tokens into RequestOutputs: incremental detokenization and stop strings.

One stream per live request. A stop string found in the text ends the request (through the
scheduler, so its blocks are freed) and cuts the text where the string starts; text that could
still become a stop string is held back until it can't. With `detokenize` off, a request without
stop strings keeps no text at all (its outputs carry token ids and an empty text delta).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import Scheduler
from engine.text_stream import TextStream
from engine.token_logprobs import TokenLogprobs


@dataclass(slots=True)
class _Stream:
    text: TextStream | None  # None: no text kept (detokenize off, no stop strings)
    num_sent: int = 0  # output tokens already reported


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.detokenize = detokenize
        self._streams: dict[str, _Stream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def open(self, req: Request) -> None:
        text = None
        if self.detokenize or req.sampling.stop:
            text = TextStream(self.tokenizer, req.prompt_token_ids, req.sampling)
        self._streams[req.request_id] = _Stream(text)

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def emit(self, req: Request, lp: TokenLogprobs | None) -> RequestOutput:
        """The output for `req`'s tokens since the last emit; ends its stream when finished."""
        st = self._streams[req.request_id]
        new_ids = tuple(req.token_ids[req.num_prompt_tokens + st.num_sent :])
        if new_ids and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        prompt_lps: tuple[TokenLogprobs, ...] = ()
        if new_ids and not st.num_sent and req.sampling.prompt_logprobs is not None:
            prompt_lps = tuple(req.prompt_logprobs)  # with the first token, then let go
            req.prompt_logprobs, req.prompt_logprobs_given = [], True
        st.num_sent += len(new_ids)
        delta, hit = "", None
        if st.text is not None:
            delta = st.text.feed(new_ids, req.is_finished)
            hit = st.text.stop_hit
        if hit is not None:
            if req.is_finished:  # EOS or length in the same step: the stop string still wins
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.request_id], FinishReason.STOP)
            req.finish_reason = FinishReason.STOP
            req.stop_reason = hit
        finished = req.is_finished
        if finished:
            del self._streams[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=(lp,) if lp is not None else (),
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            queue_s=req.queue_s,
            prefill_s=req.prefill_s,
            prompt_logprobs=prompt_lps,
        )
