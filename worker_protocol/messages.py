"""The contract between the router and the worker pools: what a worker is built from (WorkerSpec),
what it says about itself (WorkerInfo, WorkerLoad), and the messages of one request (WorkRequest,
KVTarget, PrefillResult, TokenChunk). Plain frozen data, safe to pickle. Both worker packages and
the router import this module; the engine does not: it knows nothing of pools, roles or transfer.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.device_rate import DeviceRate
from engine.outputs import RequestOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.step_stats import StepStat
from engine.token_logprobs import TokenLogprobs
from kv_transfer.faults import FaultPlan


class WorkerRole(str, enum.Enum):
    """What a worker does. A str, so that it reads as its value in labels and logs."""

    PREFILL = "prefill"  # computes a prompt's KV and streams it to a decode worker
    DECODE = "decode"  # receives KV (or prefills locally) and decodes
    BOTH = "both"  # either, request by request: prefills for a peer, or receives KV and decodes


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process builds: its engine and how many torch threads it may use."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    num_threads: int = 1
    kv_transfer_deadline_s: float = 30.0
    # How long a disaggregated request may wait for its prefill (queue + compute) on the
    # prefill worker; the decode side's receive waits this long plus the transfer deadline.
    prefill_timeout_s: float = 600.0
    # Where the worker's KV rendezvous and lanes listen (worker_protocol/address.py): by default
    # the address Ray knows the worker's node by; `kv_interface` names a network interface
    # instead (as NCCL_SOCKET_IFNAME does), `kv_host` an address.
    kv_interface: str | None = None
    kv_host: str | None = None
    pair_timeout_s: float = 10.0  # one pairing attempt with a peer
    kv_faults: FaultPlan | None = None  # faults its KV sends suffer: tests and benches only
    # KV transfer backend: "auto" (per pair: nccl between two GPUs; gloo where either cache is on
    # CPU or both share one GPU, where NCCL refuses two ranks) or "gloo"/"nccl" for every pair.
    kv_backend: str = "auto"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker is, for the router's cost model and balancer: the model's shape (FLOPs and
    KV bytes per token), the engine's limits, and the device's measured rates."""

    worker_id: str
    role: WorkerRole
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
    prefill_hold_s: float | None = None  # SchedulerConfig.prefill_hold_s
    device: str = ""  # the type of device its engine runs on ("cpu", "cuda"; "": unknown)
    incarnation: int = 0  # 0 for the first actor under this id, +1 for each replacement
    node_ip: str = ""  # the address Ray knows the worker's node by
    node_id: str = ""  # and its Ray node id
    kv_host: str = ""  # where its KV rendezvous and lanes listen
    actor_id: str = ""  # the Ray actor serving under this id now
    pid: int = 0  # its process id on its node
    # The most of its blocks that reservations for peers' KV may hold together (a worker of both
    # kinds keeps the rest for its own prefills: KVReceiverSide.reserve_share).
    reserve_share: float = 1.0


@dataclass(frozen=True, slots=True)
class WorkRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # The most its prompt may wait for decodes running where it is prefilled (the engine's
    # Request.prefill_hold_s; None: that worker's SchedulerConfig.prefill_hold_s; 0: never).
    prefill_hold_s: float | None = None


@dataclass(frozen=True, slots=True)
class KVTarget:
    """Blocks reserved on a decode worker for a disaggregated prompt, already expecting the KV.
    The first `skip_blocks` blocks of the prompt are in the decode worker's prefix cache: only
    the blocks after them travel, into `dst_block_ids`."""

    request_id: str
    dst_block_ids: tuple[int, ...]
    skip_blocks: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """One step's output for one request, as a worker streams it."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    worker_id: str = ""
    # time.monotonic() when the worker handed the chunk over: one clock for every process on a
    # host, so a reader there can measure how long the chunk took to reach it.
    emitted_at: float = 0.0
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked for them
    # With SamplingParams.prompt_logprobs, on the first chunk with a token.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    queue_s: float = 0.0  # arrival to first scheduled on the worker that streams it
    prefill_s: float = 0.0  # first scheduled to first token there (0 for a handed-off prompt)
    # On the first chunk of a handoff whose KV never arrived although the prefill worker sent
    # it: the decode worker recomputed the prompt.
    kv_recomputed: bool = False

    @classmethod
    def from_output(cls, out: RequestOutput, worker_id: str) -> TokenChunk:
        return cls(
            request_id=out.request_id,
            token_ids=out.new_token_ids,
            finished=out.finished,
            finish_reason=out.finish_reason.value if out.finish_reason else None,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            worker_id=worker_id,
            emitted_at=time.monotonic(),
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            stop_reason=out.stop_reason,
            queue_s=out.queue_s,
            prefill_s=out.prefill_s,
        )

    @classmethod
    def aborted(cls, request_id: str, worker_id: str) -> TokenChunk:
        """The one chunk of a request aborted for good on a worker before its call ran there
        (worker_protocol/ended.py)."""
        out = RequestOutput(request_id, (), "", True, finish_reason=FinishReason.ABORT)
        return cls.from_output(out, worker_id)


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
    # Prompt tokens the prefill worker found in its prefix cache (not computed again there).
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    worker_id: str
    role: WorkerRole
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
    # The totals below count from the end of the worker's warm-up (LLMEngine.reset_totals).
    preemptions: int = 0
    # Seconds its engine's model runner spent on steps (StepRecorder)
    busy_s: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, found cached
    incarnation: int = 0  # of the worker that reported it (see WorkerInfo)
    # The longest of its latest steps that ran the smallest chunks beside decodes (ChunkSizer
    # floor_s; None: none measured, or no step target): the router prices a chunk beside
    # decodes there no quicker; past the target, prompts wait for short decodes there
    # (prefill_hold_s).
    chunk_floor_s: float | None = None
    # Steps it ran its decodes alone while prompts waited for them (prefill_hold_s).
    prompt_wait_steps: int = 0
    # What is left of the hold to the prompt in line (waiting, or prefilling in chunks) with
    # the least of it, the held step running counted (Scheduler.hold_left_s): how long more
    # the prompts there may wait for decodes; 0 where one never waits; None with none in line.
    hold_left_s: float | None = None
    # (request id, prompt tokens not yet computed) of each request waiting or prefilling: how
    # far each prefill the router placed here has come.
    prefills_left: tuple[tuple[str, int], ...] = ()
