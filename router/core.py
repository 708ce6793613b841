"""The request core: every front door (gRPC, HTTP) hands it a checked request and relays what it
yields. One request, in order:
  1. admission: refused at once (Overloaded) when the queue of requests still waiting for their
     first token is full, or when the chosen path's predicted TTFT misses the request's TTFT SLO
     and waiting would help (the predicted queue time is what pushes it over); a request that
     misses its SLO on idle workers is served anyway;
  2. the policy picks the path and the workers (router/policy.py); the decision is logged with
     its inputs and kept;
  3. the pools run it (router/cluster.py); the core's books (router/pool_state.py) follow the
     request from queued prefill to decoding to done, so the next decision sees it at once;
  4. chunks stream back with text; the first one's arrival is the TTFT the client sees, and it
     trains the per-path bias and the prediction-error record; the last carries a summary.
Leaving early (client cancel or deadline) closes the stream, which aborts the request on every
worker it touched. A background task polls the workers' load and feeds their step times to the
cost model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.outputs import TokenLogprobs
from engine.prefix_hash import block_hashes
from engine.sampling_params import SamplingParams
from engine.serving import PrefillResult, TokenChunk, WorkerInfo, WorkerLoad
from router.convert import ParsedRequest, RoutePath
from router.cost_model import TransferTimeModel, prefill_pairs
from router.errors import WorkerLost
from router.policy import Decision, PathPrediction, Planner, PolicyConfig, RequestShape
from router.pool_state import WorkerState

log = logging.getLogger("pdserve.router")
MAX_RESUMES = 2  # a request outliving this many dead decode workers fails


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


class RequestCore:
    def __init__(self, backend: Backend, infos: Sequence[WorkerInfo], config: RouterConfig) -> None:
        self.backend = backend
        self.config = config
        self.states = {i.worker_id: WorkerState(i) for i in infos}
        self.block_size = infos[0].block_size
        self.transfer = TransferTimeModel()
        self.planner = Planner(config.policy, self.transfer)
        self.records: deque[DecisionRecord] = deque(maxlen=2048)
        self.pending = 0
        self.active = 0
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a worker mid-restart: keep the last figures
                log.warning("load poll failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.config.poll_interval_s)

    async def refresh(self) -> None:
        for load in await self.backend.load():
            state = self.states.get(load.worker_id)
            if state is not None:
                state.absorb(load)

    # -- one request -------------------------------------------------------------------------
    def _pools(self) -> tuple[list[WorkerState], list[WorkerState]]:
        b = self.backend
        return [self.states[w] for w in b.prefill_ids], [self.states[w] for w in b.decode_ids]

    def plan(self, req: ParsedRequest) -> tuple[RequestShape, Decision]:
        shape = RequestShape(
            prompt_len=len(req.prompt_token_ids),
            hashes=tuple(block_hashes(req.prompt_token_ids, self.block_size)),
            max_tokens=req.sampling.max_tokens,
            slo_ttft_s=(req.slo_ttft_ms / 1000) if req.slo_ttft_ms else self.config.slo_ttft_s,
            slo_itl_s=(req.slo_itl_ms / 1000) if req.slo_itl_ms else self.config.slo_itl_s,
        )
        prefill, decode = self._pools()
        return shape, self.planner.decide(shape, prefill, decode, req.path)

    def _admit(self, shape: RequestShape, decision: Decision) -> None:
        c = self.config
        if self.pending >= c.max_pending or self.active >= c.max_active:
            wait = max(0.05, decision.chosen.queue_s)
            raise Overloaded(
                "queue_full",
                f"server busy: {self.pending} requests wait for a first token "
                f"(limit {c.max_pending}), {self.active} are active (limit {c.max_active})",
                wait,
            )
        chosen = decision.chosen
        if chosen.ttft_s > shape.slo_ttft_s and chosen.queue_s > 0:
            raise Overloaded(
                "slo",
                f"predicted TTFT {chosen.ttft_s * 1000:.0f} ms exceeds the TTFT SLO "
                f"{shape.slo_ttft_s * 1000:.0f} ms ({chosen.queue_s * 1000:.0f} ms of it queueing)",
                min(chosen.queue_s, chosen.ttft_s - shape.slo_ttft_s),
            )

    async def generate(self, req: ParsedRequest, arrived: float) -> AsyncGenerator[CoreChunk, None]:
        """Run one admitted request; raises Overloaded before any work is done. If its decode
        worker dies, it resumes on another from its prompt and the tokens already streamed
        (greedy output is unchanged; a seeded sample continues with a fresh generator)."""
        shape, decision = self.plan(req)
        self._admit(shape, decision)
        rid = req.request_id
        first = decision  # the decision the client is told about
        self.pending += 1
        self.active += 1
        emitted: list[int] = []
        first_at: float | None = None
        placed: list[WorkerState] = []
        try:
            for attempt in range(MAX_RESUMES + 1):
                chosen = decision.chosen
                log.info(
                    "request %s: %d prompt tokens -> %s (%s)",
                    rid,
                    shape.prompt_len,
                    chosen.path.name.lower(),
                    decision.reason,
                )
                prefill_on, d = self._place(rid, shape, chosen)
                placed += [prefill_on, d]
                params = req.sampling
                if emitted:
                    params = replace(params, max_tokens=params.max_tokens - len(emitted))
                stream = self.backend.generate(
                    req.prompt_token_ids + tuple(emitted),
                    params,
                    "disaggregated" if chosen.path is RoutePath.DISAGGREGATED else "colocated",
                    rid,
                    chosen.prefill_worker or None,
                    chosen.decode_worker,
                    self._on_prefill,
                )
                started = False
                try:
                    async for chunk in stream:
                        if not started and chunk.token_ids:
                            started = True
                            prefill_on.done(rid)
                            d.add_decode(rid, shape.prompt_len + 1, shape.slo_itl_s)
                        if first_at is None and chunk.token_ids:
                            first_at = time.monotonic()
                            self.pending -= 1
                            self._first_token(rid, first, first_at - arrived)
                        emitted.extend(chunk.token_ids)
                        d.grow(rid, len(chunk.token_ids))
                        final = None
                        if chunk.finished:
                            final = Summary(
                                finish_reason=chunk.finish_reason,
                                stop_reason=chunk.stop_reason,
                                prompt_tokens=len(req.prompt_token_ids),
                                completion_tokens=len(emitted),
                                cached_prompt_tokens=chunk.num_cached_tokens,
                                path=first.chosen.path,
                                prefill_worker=first.chosen.prefill_worker,
                                decode_worker=chosen.decode_worker,
                                ttft_s=(first_at - arrived) if first_at is not None else 0.0,
                                decision=first,
                            )
                        yield CoreChunk(rid, chunk.token_ids, chunk.text, chunk.logprobs, final)
                        if chunk.finished:
                            return
                    raise RuntimeError(f"the stream of {rid} ended before it finished")
                except WorkerLost as lost:
                    if attempt == MAX_RESUMES or not self.backend.decode_ids:
                        raise
                    log.warning("request %s: %s; resuming after %d tokens", rid, lost, len(emitted))
                    prefill_on.finish(rid)
                    d.finish(rid)
                    shape = replace(
                        shape,
                        prompt_len=shape.prompt_len + len(emitted),
                        hashes=tuple(
                            block_hashes(req.prompt_token_ids + tuple(emitted), self.block_size)
                        ),
                        max_tokens=req.sampling.max_tokens - len(emitted),
                    )
                    prefill, decode = self._pools()
                    decision = self.planner.decide(shape, prefill, decode, req.path)
                finally:
                    await _close(stream)
        finally:
            if first_at is None:
                self.pending -= 1
                self.records.append(DecisionRecord(rid, first, None))
            self.active -= 1
            for w in placed:
                w.finish(rid)

    def _place(
        self, rid: str, shape: RequestShape, chosen: PathPrediction
    ) -> tuple[WorkerState, WorkerState]:
        """Enter a placed request in the books: (the worker that prefills it, its decode worker)."""
        d = self.states[chosen.decode_worker]
        prefill_on = self.states.get(chosen.prefill_worker) or d
        hit = prefill_on.cached_tokens(shape.hashes, shape.prompt_len)
        n_prefill = shape.prompt_len - hit
        prefill_on.add_prefill(rid, n_prefill, prefill_pairs(n_prefill, hit))
        prefill_on.prefix.insert(shape.hashes)
        d.prefix.insert(shape.hashes)
        return prefill_on, d

    def _first_token(self, rid: str, decision: Decision, ttft_s: float) -> None:
        chosen = decision.chosen
        self.planner.bias[chosen.path].observe(chosen.raw_ttft_s, ttft_s)
        self.records.append(DecisionRecord(rid, decision, ttft_s))

    def _on_prefill(self, result: PrefillResult) -> None:
        if result.transfer_ok and result.bytes_sent > 0:
            self.transfer.observe(result.bytes_sent, result.transfer_s)

    # -- reading -----------------------------------------------------------------------------
    def prediction_error(self, path: RoutePath | None = None, last: int = 200) -> float | None:
        """Median |predicted - measured| / measured TTFT over the latest requests (of `path`)."""
        errs = [
            abs(r.decision.chosen.ttft_s - r.measured_ttft_s) / r.measured_ttft_s
            for r in list(self.records)[-last:]
            if r.measured_ttft_s and (path is None or r.decision.chosen.path is path)
        ]
        return statistics.median(errs) if errs else None


async def _close(stream: AsyncIterator[TokenChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
