"""The request core's types: the pools it drives (Backend), its configuration, what it yields,
and how it refuses work."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling_params import SamplingParams
from engine.token_logprobs import TokenLogprobs
from router.policy import Decision, PolicyConfig
from router.vocab import FallbackReason, FinishReason, Placement, RejectReason, RoutePath
from worker_protocol.messages import (
    PrefillResult,
    TokenChunk,
    WorkerInfo,
    WorkerLoad,
    WorkerRole,
)


class HandoffListener(Protocol):
    """What the pools tell the core about one disaggregated request's handoff."""

    def prefilled(self, result: PrefillResult) -> None:
        """The prefill worker answered (with or without a first token and a completed send)."""

    def fell_back(self, reason: FallbackReason, detail: str, wasted_s: float) -> None:
        """The decode worker prefills the prompt itself; `wasted_s` went before it knew."""

    def replanned(self, dead: str, to: str, detail: str, wasted_s: float) -> None:
        """Prefill worker `dead` died with the prompt; it is prefilled again on `to`, for the
        same decode worker; `wasted_s` went before it knew."""


class NullListener:
    """A listener that is told nothing (Cluster.generate's, where its caller gives none)."""

    def prefilled(self, result: PrefillResult) -> None:
        pass

    def fell_back(self, reason: FallbackReason, detail: str, wasted_s: float) -> None:
        pass

    def replanned(self, dead: str, to: str, detail: str, wasted_s: float) -> None:
        pass


class Backend(Protocol):
    """The pools as the core drives them (router.cluster.Cluster, or a fake)."""

    @property
    def prefill_ids(self) -> list[str]:
        """Prefill workers that take new requests now."""

    @property
    def decode_ids(self) -> list[str]:
        """Decode workers that take new requests now."""

    def worker_info(self, worker_id: str) -> WorkerInfo:
        """What the current incarnation of a worker said about itself."""

    @property
    def dead(self) -> list[str]:
        """Ids of the workers found dead, in the order found (an id once per death)."""

    @property
    def hung(self) -> list[str]:
        """Of those, the ones stopped for answering no load poll for the hang timeout."""

    @property
    def silent(self) -> set[str]:
        """Workers silent for a while (no load poll answered), not yet taken for hung: new
        requests are placed elsewhere where another worker can take them."""

    @property
    def restarts(self) -> dict[WorkerRole, int]:
        """Dead workers replaced by a new one that took load, by role, since the start."""

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        placement: Placement,
        on_prefill: HandoffListener | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Stream one request's chunks where `placement` says. Closing the stream before its last
        chunk (or a failure) aborts the request on every worker it touched. `on_prefill` hears
        how the handoff went on the disaggregated path."""

    async def load(self, wait_s: float | None = None) -> list[WorkerLoad]:
        """The load of the workers that answer within `wait_s` (None: the backend's own limit);
        a worker silent for the hang timeout is stopped and replaced."""

    async def infos(self) -> list[WorkerInfo]: ...

    def set_step_target(
        self, worker_id: str, target_s: float | None, seq: int = 0
    ) -> Awaitable[None]:
        """Retarget a worker's prefill chunks next to its decodes (engine.Scheduler). The call
        leaves when this is called; the awaitable ends once the worker has it. `seq` numbers the
        calls (rising): a worker ignores one numbered below the latest it took, as Ray may run
        its calls out of order (0: unnumbered)."""


class Overloaded(Exception):
    """Admission refused; the client may retry after `retry_after_s`."""

    def __init__(self, reason: RejectReason, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class NoWorkers(RuntimeError):
    """No decode worker is up: nothing can run until one is."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    slo_ttft_s: float = 60.0  # a request's TTFT SLO when it gives none
    slo_itl_s: float = 1.0  # a request's ITL SLO when it gives none
    max_pending: int = 256  # admitted requests still waiting for their first token
    max_active: int = 4096  # admitted requests not yet finished
    poll_interval_s: float = 0.1
    # How long one poll waits for the workers' load; a slower worker's answer comes to a later
    # poll, which does not wait for it again (router/load_poll.py).
    poll_wait_s: float = 2.0
    # Tune each worker's step target from the ITL its requests see (router/step_target.py);
    # the workers must start with chunked prefill and a step target.
    tune_step_target: bool = False
    # Each request's prompt may wait for the decodes running where it is prefilled (where a
    # chunk beside them cannot keep to the step target) up to this share of its TTFT SLO
    # (Placement.prefill_hold_s); None: the workers' own hold (SchedulerConfig.prefill_hold_s).
    prefill_hold_share: float | None = None
    # Refuse a request whose taking sets a rate of requests at which the decodes' p99 gap
    # passes its ITL SLO in steady state (router/capacity.py DecodeDemand.overload).
    decode_rate_admission: bool = True

    def __post_init__(self) -> None:
        share = self.prefill_hold_share
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"prefill_hold_share must be in [0, 1], got {share}")


@dataclass(frozen=True, slots=True)
class Summary:
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    path: RoutePath
    prefill_worker: str
    decode_worker: str
    ttft_s: float
    decision: Decision
    kv_fallback: FallbackReason | None = None  # a disaggregated request prefilled locally
    # A LENGTH finish neither max_tokens nor the context made: what did (kv_cache_capacity).
    length_reason: str | None = None
    resumed: int = 0  # times it moved to another decode worker (the placement is the last)


@dataclass(frozen=True, slots=True)
class CoreChunk:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()
    final: Summary | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with sampling.prompt_logprobs, first chunk


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    request_id: str
    decision: Decision
    measured_ttft_s: float | None  # None: no token came
    # A fault had a hand in its first token (a fallback, a re-plan or a resume): its TTFT says
    # little about how the predictions hold, and the admission margin leaves it out.
    disturbed: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer, for the front doors' calls that do not stream."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    final: Summary
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with sampling.prompt_logprobs


async def collect(chunks: AsyncIterator[CoreChunk]) -> Answer:
    """Read a request's chunks up to its final one."""
    text: list[str] = []
    ids: list[int] = []
    lps: list[TokenLogprobs] = []
    prompt_lps: list[TokenLogprobs] = []
    async for c in chunks:
        text.append(c.text)
        ids.extend(c.token_ids)
        lps.extend(c.logprobs)
        prompt_lps.extend(c.prompt_logprobs)
        if c.final is not None:
            return Answer("".join(text), tuple(ids), tuple(lps), c.final, tuple(prompt_lps))
    raise RuntimeError("the request's stream ended without its final chunk")
