"""The request core's types: the pools it drives (Backend), its configuration, what it yields,
and how it refuses work."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.serving import TokenChunk, WorkerInfo, WorkerLoad
from router.convert import RoutePath
from router.policy import Decision, PolicyConfig


class Backend(Protocol):
    """The pools as the core drives them (router.cluster.Cluster, or a fake)."""

    prefill_ids: list[str]  # live workers, updated as they die
    decode_ids: list[str]

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        path: str,
        request_id: str | None,
        prefill_worker: str | None,
        decode_worker: str | None,
        on_prefill: Any = None,
    ) -> AsyncIterator[TokenChunk]: ...

    async def load(self) -> list[WorkerLoad]: ...

    async def infos(self) -> list[WorkerInfo]: ...


class Overloaded(Exception):
    """Admission refused; the client may retry after `retry_after_s`."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
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


@dataclass(frozen=True, slots=True)
class Summary:
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    path: RoutePath
    prefill_worker: str
    decode_worker: str
    ttft_s: float
    decision: Decision


@dataclass(frozen=True, slots=True)
class CoreChunk:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()
    final: Summary | None = None


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    request_id: str
    decision: Decision
    measured_ttft_s: float | None  # None: no token came
