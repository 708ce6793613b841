"""Request state: the status machine and the token bookkeeping one sequence carries.

Status transitions (no others are legal):

    WAITING ──schedule──> RUNNING ──stop/length──> FINISHED_STOPPED | FINISHED_LENGTH
       ^                    │
       └──── PREEMPTED <────┘  (blocks ran out: recompute from prompt + outputs)
    WAITING_FOR_KV ──kv arrived──> RUNNING          (disaggregated decode side)
    any unfinished ──abort──> FINISHED_ABORTED

Invariant: `num_computed_tokens <= len(token_ids)`; the KV of the first `num_computed_tokens`
tokens is in `block_ids`, in order.
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.token_logprobs import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(slots=True, eq=False)  # identity: two requests are never 'equal'
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    status: RequestStatus = RequestStatus.WAITING
    # prompt followed by outputs; the sequence whose KV the cache holds
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # chained hashes of the full blocks of token_ids, extended lazily
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit at first scheduling
    num_registered_blocks: int = 0  # leading blocks already named in the prefix cache
    num_preemptions: int = 0
    # Prefill role: keep the blocks after finishing, until the KV has been sent.
    hold_blocks_on_finish: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    scheduled_time: float | None = None  # time.monotonic() when first scheduled
    first_token_time: float | None = None  # time.monotonic() when its first output was emitted
    # The most its prefill may wait for running decodes to end, in all (None: the scheduler's
    # SchedulerConfig.prefill_hold_s; 0: never), and the seconds it has waited so far.
    prefill_hold_s: float | None = None
    held_s: float = 0.0
    # Waiting for KV (kv_handoff.reserve): time.monotonic() from which its KV may land. Until
    # then it neither shrinks the prefill chunks here nor holds prompts for its decode.
    kv_due_at: float = 0.0
    # Alone and out of blocks that others hold for a while: time.monotonic() it began to wait
    # for them (Scheduler._waits_for_blocks); None while it runs.
    blocks_wait_since: float | None = None
    # A penalized request's token_ids as int64, extended where it samples (engine/seen.py).
    seen_ids: array[int] | None = None
    # With sampling.prompt_logprobs: those computed so far, one per prompt position p (the
    # logprob of prompt token p + 1); emptied once given (with the first output), which
    # `prompt_logprobs_given` then says.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_given: bool = False

    @property
    def queue_s(self) -> float:
        """Arrival to first scheduled (so far, while it still waits)."""
        end = self.scheduled_time if self.scheduled_time is not None else time.monotonic()
        return max(0.0, end - self.arrival_time)

    @property
    def prefill_s(self) -> float:
        """First scheduled to first output token (0 until both happened)."""
        if self.scheduled_time is None or self.first_token_time is None:
            return 0.0
        return max(0.0, self.first_token_time - self.scheduled_time)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def prompt_logprobs_due(self) -> bool:
        """Whether prompt logprobs are asked for and not all computed yet."""
        return (
            self.sampling.prompt_logprobs is not None
            and not self.prompt_logprobs_given
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop_token(self) -> FinishReason | None:
        """Stop on a stop token id, EOS, max_tokens or the model's context. stop_reason names a
        stop token id that ended it, not EOS (as vLLM's: None for the model's own end)."""
        last = self.token_ids[-1]
        sp = self.sampling
        if last in sp.stop_token_ids:
            self.stop_reason = last
            return FinishReason.STOP
        if not sp.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if self.num_output_tokens >= sp.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
