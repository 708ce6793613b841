"""Cluster: the prefill and decode pools as Ray actors, and the two paths a request can take.

Colocated: decode worker D prefills the prompt in chunks next to its running decodes and
streams tokens.
Disaggregated, in order (DESIGN.md, request lifecycle):
  1. D reserves blocks for the prompt and reports its prefix-cache hit;
  2. D starts receiving into the blocks past the hit;
  3. prefill worker P prefills, streams the KV layer by layer, returns the first token, and frees
     its blocks once the send has ended;
  4. D joins the request to its batch with that token (or recomputes if the KV never came) and
     streams the rest.
Pairs are connected lazily, the first time P and D meet. With no cluster address, Ray starts
locally with every socket on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
import torch

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.serving import (
    PrefillResult,
    TokenChunk,
    WorkerInfo,
    WorkerLoad,
    WorkerSpec,
    WorkRequest,
)
from kv_transfer import TransferStats
from prefill_worker.worker import PrefillWorker
from router.errors import WorkerLost

PATHS = ("colocated", "disaggregated")
log = logging.getLogger("pdserve.cluster")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str = "smollm2-135m"
    num_prefill: int = 1
    num_decode: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)  # its model name is replaced
    threads_per_worker: int = 1
    kv_transfer_deadline_s: float = 30.0
    prefill_timeout_s: float = 600.0  # a prefill's queue wait and compute on its worker
    address: str | None = None  # an existing Ray cluster; None starts one locally
    # GPUs per worker actor; None: 1 where CUDA is present, else 0. Fractions share a device.
    gpus_per_worker: float | None = None
    kv_backend: str = "auto"  # see WorkerSpec.kv_backend
    start_timeout_s: float = 300.0
    control_timeout_s: float = 30.0  # a control call to a worker (reserve, abort, load, pairing)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("need num_prefill >= 0 and num_decode >= 1")


def init_ray(address: str | None) -> None:
    """Join `address`, or start a local Ray that listens on 127.0.0.1 only. Call it from a
    thread that lives as long as the process (the main thread): Ray's own processes are told
    to die with the thread that started them."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    # router/__init__.py has told Ray (before its import) to bind 127.0.0.1 only.
    ray.init(
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        init_ray(config.address)
        gpus = config.gpus_per_worker
        if gpus is None:
            gpus = 1 if torch.cuda.is_available() else 0
        engine = replace(config.engine, model=replace(config.engine.model, model=config.model))
        spec = WorkerSpec(
            engine=engine,
            num_threads=config.threads_per_worker,
            kv_transfer_deadline_s=config.kv_transfer_deadline_s,
            prefill_timeout_s=config.prefill_timeout_s,
            kv_backend=config.kv_backend,
        )
        # CPU actors take no Ray CPU slot: each sets its own torch thread count instead, and a
        # slot per actor would starve later tasks on a small machine.
        opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": gpus, "max_concurrency": 1000}
        self.prefill_ids = [f"prefill-{i}" for i in range(config.num_prefill)]
        self.decode_ids = [f"decode-{i}" for i in range(config.num_decode)]
        self.prefill: dict[str, Any] = {
            w: ray.remote(PrefillWorker).options(**opts).remote(w, spec) for w in self.prefill_ids
        }
        self.decode: dict[str, Any] = {
            w: ray.remote(DecodeWorker).options(**opts).remote(w, spec) for w in self.decode_ids
        }
        actors = [*self.prefill.values(), *self.decode.values()]
        try:
            ray.get([a.ready.remote() for a in actors], timeout=config.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for a in actors:
                ray.kill(a)
            raise RuntimeError(
                f"{len(actors)} workers did not start within {config.start_timeout_s:.0f} s: "
                f"each asks for {gpus} GPU(s) (see ClusterConfig.gpus_per_worker) and Ray "
                f"has {ray.cluster_resources().get('GPU', 0)}"
            ) from None
        self.block_size = engine.cache.block_size
        self._pairs: dict[tuple[str, str], asyncio.Task[None]] = {}  # pairing in progress
        self._paired: set[tuple[str, str]] = set()
        self.dead: list[str] = []  # workers found dead, in the order they were found
        # (request id, why) for each disaggregated request prefilled on its decode worker
        self.fallbacks: list[tuple[str, str]] = []
        self._rr = itertools.count()
        self._ids = itertools.count()

    # -- placement ---------------------------------------------------------------------------
    def _pick(self, ids: Sequence[str]) -> str:
        return ids[next(self._rr) % len(ids)]

    async def _ensure_pair(self, p: str, d: str) -> None:
        if (p, d) in self._paired:
            return
        task = self._pairs.get((p, d))
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = asyncio.ensure_future(self._connect(p, d))
            self._pairs[(p, d)] = task
        try:
            # Shielded: one waiter giving up must not cancel the pairing the others wait for.
            await asyncio.wait_for(asyncio.shield(task), self.config.control_timeout_s)
            self._paired.add((p, d))
        except Exception:
            if self._pairs.get((p, d)) is task:
                del self._pairs[(p, d)]  # the next request tries again
            raise

    async def _connect(self, p: str, d: str) -> None:
        address = await self.decode[d].listen.remote(p)
        await asyncio.gather(
            self.decode[d].connect.remote(p, address, True),
            self.prefill[p].connect.remote(d, address, False),
        )

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        path: str = "colocated",
        request_id: str | None = None,
        prefill_worker: str | None = None,
        decode_worker: str | None = None,
        on_prefill: Callable[[PrefillResult], None] | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Stream one request's chunks. Leaving early (or failing) aborts it on every worker
        it touched, so its blocks are freed there. `on_prefill` sees the prefill worker's
        result on the disaggregated path."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        rid = request_id or f"cl-{next(self._ids)}"
        req = WorkRequest(rid, tuple(int(t) for t in prompt_token_ids), params)
        d = decode_worker or self._pick(self.decode_ids)
        p: str | None = None
        if path == "disaggregated" and self.prefill_ids:
            p = prefill_worker or self._pick(self.prefill_ids)
            stream = self._disaggregated(req, p, d, on_prefill)
        else:
            stream = self._stream(self.decode[d].generate, req)
        finished = False
        try:
            async for chunk in stream:
                finished = chunk.finished
                yield chunk
        except ray.exceptions.RayActorError as exc:
            if not self._note_failure(self.decode_ids, self.decode, d, exc):
                raise
            raise WorkerLost(d, f"{type(exc).__name__}") from exc
        finally:
            if not finished:
                await asyncio.shield(self._abort(rid, p, d))

    async def _abort(self, rid: str, p: str | None, d: str) -> None:
        actors = [self.decode[d]] + ([self.prefill[p]] if p is not None else [])
        timeout = self.config.control_timeout_s
        results = await asyncio.gather(
            *(asyncio.wait_for(a.abort.remote(rid), timeout) for a in actors),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ray.exceptions.RayActorError):
                log.warning("abort of %s failed: %s: %s", rid, type(r).__name__, r)

    async def _stream(self, method: Any, *args: Any) -> AsyncIterator[TokenChunk]:
        gen = method.options(num_returns="streaming").remote(*args)
        async for ref in gen:
            yield await ref

    async def _disaggregated(
        self,
        req: WorkRequest,
        p: str,
        d: str,
        on_prefill: Callable[[PrefillResult], None] | None,
    ) -> AsyncIterator[TokenChunk]:
        try:
            await self._ensure_pair(p, d)
        except Exception as exc:  # the pair can't be made (a worker died): D prefills itself
            self._note_failure(self.prefill_ids, self.prefill, p, exc)
            self._fallback(req, f"pairing {p}-{d} failed: {type(exc).__name__}: {exc}")
            async for chunk in self._stream(self.decode[d].generate, req):
                yield chunk
            return
        res = await asyncio.wait_for(
            self.decode[d].reserve.remote(req), self.config.control_timeout_s
        )
        if res is None:  # D is full right now: it queues the request and prefills it itself
            self._fallback(req, f"{d} had no free blocks or sequence slot to reserve")
            async for chunk in self._stream(self.decode[d].generate, req):
                yield chunk
            return
        skip = res.num_cached_tokens // self.block_size
        dst = tuple(res.block_ids[skip:])
        first: int | None = None
        first_lp = None
        try:
            await asyncio.wait_for(
                self.decode[d].expect_kv.remote(req.request_id, p, dst),
                self.config.control_timeout_s,
            )
            limit = self.config.prefill_timeout_s + self.config.kv_transfer_deadline_s
            result: PrefillResult = await asyncio.wait_for(
                self.prefill[p].prefill.remote(req, d, dst, skip), limit
            )
            if on_prefill is not None:
                on_prefill(result)
            first = result.first_token
            first_lp = result.first_logprobs
            if first is not None and not result.transfer_ok:
                self._fallback(req, f"KV transfer {p} -> {d} failed: {result.error}")
                await self._check_pair(p, d)
        except Exception as exc:  # D recomputes the prompt in the blocks it reserved
            self._note_failure(self.prefill_ids, self.prefill, p, exc)
            self._fallback(req, f"handoff {p} -> {d} failed: {type(exc).__name__}: {exc}")
        async for chunk in self._stream(
            self.decode[d].finish_handoff, req.request_id, first, first_lp
        ):
            yield chunk

    async def _check_pair(self, p: str, d: str) -> None:
        """After a failed transfer: if either side lost the pair, close both ends, so the next
        request pairs them afresh instead of failing the same way."""
        try:
            ok = all(
                await asyncio.gather(
                    self.prefill[p].connected.remote(d), self.decode[d].connected.remote(p)
                )
            )
        except ray.exceptions.RayActorError:
            ok = False
        if ok:
            return
        self._paired.discard((p, d))
        for actor, peer in ((self.prefill[p], d), (self.decode[d], p)):
            try:
                await actor.disconnect.remote(peer)
            except ray.exceptions.RayActorError:
                pass  # that side is gone; its end went with it

    def _fallback(self, req: WorkRequest, reason: str) -> None:
        """A disaggregated request that the decode worker prefills itself: counted and logged."""
        self.fallbacks.append((req.request_id, reason))
        log.warning("request %s: %s; prefilling on the decode worker", req.request_id, reason)

    def _note_failure(
        self, ids: list[str], actors: dict[str, Any], worker: str, exc: BaseException
    ) -> bool:
        """A worker whose actor died leaves its pool (`ids`); later requests skip it. True when
        `exc` says that `worker` died (now or before)."""
        if not isinstance(exc, ray.exceptions.RayActorError) or isinstance(
            exc,
            ray.exceptions.ActorUnavailableError,  # transient: it may answer again
        ):
            return False
        dead_id = getattr(exc, "actor_id", None)
        if dead_id is not None and dead_id != actors[worker]._actor_id.hex():
            return False  # another actor died under this call
        if worker in ids:
            ids.remove(worker)
            self.dead.append(worker)
            log.warning("worker %s died and left its pool", worker)
        return True

    async def kv_stats(self) -> dict[str, TransferStats]:
        """Each worker's KV transfer totals, by worker id."""
        items = self._live()
        stats = await asyncio.gather(*(a.kv_stats.remote() for _, a in items))
        return {w: s for (w, _), s in zip(items, stats)}

    async def infos(self) -> list[WorkerInfo]:
        """What every live worker is (model shape, limits, measured device rates)."""
        return list(await asyncio.gather(*(a.info.remote() for _, a in self._live())))

    async def load(self) -> list[WorkerLoad]:
        """Load figures of every live worker that answers within the control timeout; a worker
        found dead leaves its pool."""
        items = self._live()
        timeout = self.config.control_timeout_s
        loads = await asyncio.gather(
            *(asyncio.wait_for(a.load.remote(), timeout) for _, a in items),
            return_exceptions=True,
        )
        out: list[WorkerLoad] = []
        for (w, _), ld in zip(items, loads):
            if isinstance(ld, WorkerLoad):
                out.append(ld)
            elif w in self.prefill_ids:
                self._note_failure(self.prefill_ids, self.prefill, w, ld)
            else:
                self._note_failure(self.decode_ids, self.decode, w, ld)
        return out

    def _live(self) -> list[tuple[str, Any]]:
        return [(w, self.prefill[w]) for w in self.prefill_ids] + [
            (w, self.decode[w]) for w in self.decode_ids
        ]

    def shutdown(self) -> None:
        for _, a in self._live():
            try:
                ray.get(a.shutdown.remote(), timeout=10)
            except Exception:
                pass  # already gone: killing it below is all that is left
            ray.kill(a)
