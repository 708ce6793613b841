"""One request's timeline as the router sees it, kept while it streams and turned into a
RequestRecord at the end. All times are time.monotonic()."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from router.stats import FirstTokenRecord, RequestRecord
from router.vocab import FallbackReason, FinishReason, Frontend
from worker_protocol.messages import PrefillResult, TokenChunk


@dataclass(slots=True)
class Tracker:
    request_id: str
    arrived: float
    path: str
    frontend: Frontend
    prompt_tokens: int
    predicted_ttft_s: float
    first_at: float | None = None
    last_at: float | None = None
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    queue_s: float = 0.0
    prefill_s: float | None = None
    finish_reason: FinishReason = FinishReason.ABORT  # until it ends: the client left, or a failure
    length_reason: str | None = None  # what cut a LENGTH finish short (kv_cache_capacity)
    resumed: int = 0
    handed_off: bool = False  # the prefill worker's KV reached the decode worker
    kv_fallback: FallbackReason | None = None  # why the decode worker prefilled it after all
    replanned_to: str | None = None  # the prefill worker it moved to after its own died
    # The prefill worker's prefix-cache hit where its KV reached the decode worker (the prompt
    # tokens not computed for it); None where the decode worker prefilled it.
    prefiller_cached: int | None = None

    def prefilled(self, result: PrefillResult) -> None:
        """The prefill worker's own figures (disaggregated path), for the first prefill only
        (a resumed request's later prefill does not change its TTFT's story)."""
        if result.first_token is None or self.first_at is not None:
            return
        self.handed_off = result.transfer_ok
        self.queue_s = result.queue_s
        self.prefill_s = max(0.0, result.prefill_s - result.queue_s)

    def chunk(self, chunk: TokenChunk) -> list[float]:
        """Book a chunk; returns the inter-token gaps it adds."""
        now = time.monotonic()
        n = len(chunk.token_ids)
        gaps: list[float] = []
        if n:
            if self.first_at is None:
                self.first_at = now
                if not self.handed_off:
                    self.queue_s = chunk.queue_s
                    self.prefill_s = chunk.prefill_s
            elif self.last_at is not None:
                # Tokens that arrive together share the gap since the previous ones.
                gaps = [(now - self.last_at) / n] * n
                self.itl_s.extend(gaps)
            self.last_at = now
            self.output_tokens += n
        return gaps

    def ended(
        self,
        finish_reason: FinishReason | None,
        cached_prompt_tokens: int,
        length_reason: str | None = None,
    ) -> None:
        self.finish_reason = finish_reason or FinishReason.STOP
        self.cached_prompt_tokens = cached_prompt_tokens
        self.length_reason = length_reason

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.arrived

    def first_token(self) -> FirstTokenRecord:
        return FirstTokenRecord(
            path=self.path,
            frontend=self.frontend,
            ttft_s=self.ttft_s or 0.0,
            queue_s=self.queue_s,
            prefill_s=self.prefill_s,
            predicted_ttft_s=self.predicted_ttft_s,
        )

    def record(self, failed: bool = False) -> RequestRecord:
        end = self.last_at if self.last_at is not None else time.monotonic()
        return RequestRecord(
            request_id=self.request_id,
            path=self.path,
            frontend=self.frontend,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            output_tokens=self.output_tokens,
            finish_reason="error" if failed else self.finish_reason.value,
            ttft_s=self.ttft_s,
            predicted_ttft_s=self.predicted_ttft_s,
            itl_s=tuple(self.itl_s),
            e2e_s=max(0.0, end - self.arrived),
            queue_s=self.queue_s,
            prefill_s=self.prefill_s,
            resumed=self.resumed,
            length_reason=None if failed else self.length_reason,
        )
