"""Messages between scheduler, runner and engine user. Immutable: a step's facts never change.

The two made once per request per step (ScheduledRequest, RequestOutput) are NamedTuples: as
immutable as a frozen dataclass, at half its construction cost on the step's hot path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.seen import Seen
from engine.token_logprobs import TokenLogprobs


class ScheduledRequest(NamedTuple):
    """One request's share of a step: compute `token_ids` at positions start_pos.."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]  # the request's whole block table
    sample: bool  # the chunk ends the known sequence: sample the next token
    sampling: SamplingParams
    # A penalized request's tokens where it samples (else None): a view of a buffer that only
    # grows, read in this step (engine/seen.py).
    seen: Seen | None = None
    # With prompt logprobs due: the prompt tokens that follow the chunk's positions from
    # `prompt_from` on (one per position whose logprob is computed this step).
    prompt_targets: tuple[int, ...] = ()
    prompt_from: int = 0  # index in token_ids of the first position with a target


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...] = ()
    # requests that ended since the previous step: the runner drops their per-request state
    finished_request_ids: tuple[str, ...] = ()
    prompt_rows: bool = False  # some scheduled request has prompt_targets

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Sampled tokens, one per scheduled request with `sample` set (decodes first)."""

    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    # (request id, the prompt logprobs computed this step for its chunk's positions, in order)
    prompt_logprobs: tuple[tuple[str, tuple[TokenLogprobs, ...]], ...] = ()


class RequestOutput(NamedTuple):
    """What one step produced for one request, as the engine's caller sees it."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_s: float = 0.0  # arrival to first scheduled, on this engine
    prefill_s: float = 0.0  # first scheduled to first output token, on this engine
    # With SamplingParams.prompt_logprobs, on the first output with a token: one per prompt
    # token after the first (the logprob of token p + 1 given tokens 0..p).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
