"""Messages between the router and the worker pools (plain frozen data, safe to pickle)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process builds: its engine and how many torch threads it may use."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    num_threads: int = 1
    kv_transfer_deadline_s: float = 30.0
    # How long a disaggregated request may wait for its prefill (queue + compute) on the
    # prefill worker; the decode side's receive waits this long plus the transfer deadline.
    prefill_timeout_s: float = 600.0
    bind_host: str = "127.0.0.1"
    # KV transfer backend: "auto" (nccl for CUDA caches, gloo for CPU ones) or "gloo"/"nccl".
    # Two workers on one GPU need "gloo": NCCL refuses two ranks on one device.
    kv_backend: str = "auto"


@dataclass(frozen=True, slots=True)
class WorkRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """One step's output for one request, as a worker streams it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    worker_id: str = ""
    # time.monotonic() when the worker handed the chunk over: one clock for every process on a
    # host, so a reader there can measure how long the chunk took to reach it.
    emitted_at: float = 0.0
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked for them
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @classmethod
    def from_output(cls, out: RequestOutput, worker_id: str) -> TokenChunk:
        return cls(
            request_id=out.request_id,
            token_ids=out.new_token_ids,
            text=out.text_delta,
            finished=out.finished,
            finish_reason=out.finish_reason.value if out.finish_reason else None,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            worker_id=worker_id,
            emitted_at=time.monotonic(),
            logprobs=out.logprobs,
            stop_reason=out.stop_reason,
        )


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first_token: int
    first_logprobs: TokenLogprobs | None  # when the request asked for logprobs
    transfer_ok: bool
    prefill_s: float  # request added -> first token sampled
    transfer_s: float  # first token -> send ended
    bytes_sent: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    worker_id: str
    role: str  # "prefill" | "decode"
    running: int
    waiting: int
    waiting_for_kv: int
    kv_usage: float  # fraction of blocks in use
    num_free_blocks: int
    num_blocks: int
    queued_prefill_tokens: int  # prompt tokens not yet computed, over waiting and running
    held: int = 0  # finished requests whose blocks wait for their KV send to end
    open_transfers: int = 0  # KV transfers the worker's connector still tracks


def engine_load(engine: LLMEngine, worker_id: str, role: str) -> WorkerLoad:
    """A worker's load figures, read on the engine thread."""
    sched = engine.scheduler
    queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
    queued += sum(
        r.num_tokens - r.num_computed_tokens - 1
        for r in sched.running
        if r.num_tokens - r.num_computed_tokens > 1
    )
    pool = engine.kv.pool
    return WorkerLoad(
        worker_id=worker_id,
        role=role,
        running=len(sched.running),
        waiting=len(sched.waiting),
        waiting_for_kv=len(sched.waiting_for_kv),
        kv_usage=pool.usage,
        num_free_blocks=pool.num_free_blocks,
        num_blocks=pool.num_blocks,
        queued_prefill_tokens=queued,
        held=len(sched.held),
    )
