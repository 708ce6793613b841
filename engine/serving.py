"""Messages between the router and the worker pools (plain frozen data, safe to pickle)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import EngineConfig
from engine.device_rate import DeviceRate
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.step_stats import StepStat


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
class WorkerInfo:
    """What a worker is, for the router's cost model and balancer: the model's shape (FLOPs and
    KV bytes per token), the engine's limits, and the device's measured rates."""

    worker_id: str
    role: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int  # without the embedding table
    weight_bytes: int
    kv_bytes_per_token: int  # all layers, K and V
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    rate: DeviceRate
    step_target_s: float | None = None  # SchedulerConfig.step_target_s where chunking is on


def worker_info(engine: LLMEngine, worker_id: str, role: str, rate: DeviceRate) -> WorkerInfo:
    model: Any = engine.loaded.hf_model
    cfg = model.config
    spec = engine.runner.spec
    embed = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters())
    # The output head may share the embedding table; only its matmul counts as compute.
    num_params = params - embed.numel()
    if model.get_output_embeddings() is not None and model.config.tie_word_embeddings:
        num_params += embed.numel()
    elem = torch.empty((), dtype=spec.dtype).element_size()
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        num_layers=spec.num_layers,
        num_heads=int(cfg.num_attention_heads),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_params=num_params,
        weight_bytes=params * elem,
        kv_bytes_per_token=2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem,
        block_size=spec.block_size,
        num_blocks=engine.runner.num_blocks,
        max_num_batched_tokens=engine.config.scheduler.max_num_batched_tokens,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        rate=rate,
        step_target_s=engine.scheduler.sizer.target_s if engine.scheduler.sizer else None,
    )


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
    queue_s: float = 0.0  # arrival to first scheduled on the worker that streams it
    prefill_s: float = 0.0  # first scheduled to first token there (0 for a handed-off prompt)

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
            queue_s=out.queue_s,
            prefill_s=out.prefill_s,
        )


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first_token: int | None  # None: aborted before the prompt was prefilled
    first_logprobs: TokenLogprobs | None  # when the request asked for logprobs
    transfer_ok: bool
    prefill_s: float  # request added -> first token sampled
    transfer_s: float  # first token -> send ended
    bytes_sent: int
    error: str | None = None
    queue_s: float = 0.0  # arrival to first scheduled on the prefill worker
    send_s: float = 0.0  # the connector's own: send started -> ended
    failure_reason: str | None = None  # kv_transfer.FailureReason value when the send failed


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
    steps: tuple[StepStat, ...] = ()  # steps executed since the previous load() (at most 256)
    preemptions: int = 0  # since the worker started
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int = 0  # of those, found cached


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
        steps=engine.step_stats.drain(),
        preemptions=sched.num_preemptions,
        prefix_queries=pool.stats.queries,
        prefix_hits=pool.stats.hits,
    )
