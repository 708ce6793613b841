"""EngineHost: what every pool worker is around its engine, whatever its role.

It builds the process's one engine (with its torch thread count) and the engine thread that
drives it, works out where its KV transfer listens (address.py), answers readiness and load
questions, warms up, runs a request here whole (`generate`: the colocated path), and stops.
The transfer side of a worker comes from kv_transfer's KVEndpoint; a worker class combines the
two.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import torch

from engine.async_engine import AsyncEngine, LayerHook
from engine.device_rate import DeviceRate, measure_device
from engine.kv_cache import KVCacheSource
from engine.llm_engine import LLMEngine
from engine.outputs import SchedulerOutput
from engine.sampling_params import SamplingParams
from worker_protocol.address import kv_bind_host, node_ip
from worker_protocol.code_id import code_id, refuse_other_code
from worker_protocol.ended import EndedRequests
from worker_protocol.messages import (
    TokenChunk,
    WorkerInfo,
    WorkerLoad,
    WorkerRole,
    WorkerSpec,
    WorkRequest,
)

WARMUP_PROMPT_TOKENS = 8
# Then prompts alone of these sizes (up to the token budget), one step each, so that the
# scheduler knows from the first request what a step of prompts costs (engine/prompt_steps.py).
WARMUP_PROMPT_STEPS = (8, 16, 32, 64)
WARMUP_ROUNDS = 2


def worker_sampling_seed(seed: int, worker_id: str, incarnation: int) -> int:
    """The seed a worker's engine draws unseeded requests' seeds from, given the server's
    (`serve --seed`): its own per worker id and incarnation, so that two workers (or a worker
    and its replacement) never hand two requests the same seeds, and a run repeats."""
    digest = hashlib.sha256(f"{seed}/{worker_id}/{incarnation}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class EngineHost:
    role: WorkerRole

    def __init__(
        self,
        worker_id: str,
        spec: WorkerSpec,
        incarnation: int = 0,
        on_layer: LayerHook | None = None,
        wants_layers: Callable[[SchedulerOutput], bool] | None = None,
        router_code: str | None = None,
    ) -> None:
        refuse_other_code(router_code)  # before the model loads
        torch.set_num_threads(spec.num_threads)
        self.worker_id = worker_id
        self.spec = spec
        self.node_ip = node_ip()
        self.kv_host = kv_bind_host(self.node_ip, spec.kv_interface, spec.kv_host)
        self.ended = EndedRequests()  # request ids aborted for good here (ended.py)
        self._target_seq = 0  # the number of the latest step target taken
        # The router detokenizes what workers stream: a worker decodes text only to find stop
        # strings. A prefill worker's steps stream KV layer by layer, which a captured decode
        # graph cannot: it captures none (a worker that does both replays graphs in the steps
        # that send nothing: `wants_layers`).
        engine = replace(spec.engine, detokenize=False)
        seed = engine.model.sampling_seed
        if seed is not None:  # one stream per worker: two never draw the same seeds
            seed = worker_sampling_seed(seed, worker_id, incarnation)
            engine = replace(engine, model=replace(engine.model, sampling_seed=seed))
        if self.role is WorkerRole.PREFILL:
            engine = replace(engine, model=replace(engine.model, enforce_eager=True))
        self.engine = LLMEngine(engine)
        self.aeng = AsyncEngine(
            self.engine, on_layer=on_layer, wants_layers=wants_layers, on_dead=self._engine_died
        )
        rate = measure_device(self.engine.runner.device, self.engine.runner.dtype)
        self._info = worker_info(
            self.engine,
            worker_id,
            self.role,
            rate,
            incarnation=incarnation,
            node_ip=self.node_ip,
            node_id=_node_id(),
            kv_host=self.kv_host,
            actor_id=_actor_id(),
            pid=os.getpid(),
            reserve_share=float(getattr(self, "reserve_share", 1.0)),  # KVReceiverSide's
        )

    def _engine_died(self, exc: BaseException) -> None:
        """A step raised: this worker can serve nothing more. Ending the process makes Ray
        report the actor dead, so the router resumes its requests elsewhere and replaces it
        (a live actor with a dead engine would fail every request sent to it)."""
        traceback.print_exception(exc, file=sys.stderr)
        print(f"worker {self.worker_id}: engine step failed; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def kv_source(self) -> KVCacheSource:
        loaded, runner = self.engine.loaded, self.engine.runner
        return KVCacheSource(
            runner.spec, runner.device, loaded.name, loaded.hf_model.config.to_json_string()
        )

    def ready(self) -> WorkerInfo:
        return self._info

    def info(self) -> WorkerInfo:
        return self._info

    def code_id(self) -> str:
        """The code it runs (worker_protocol/code_id.py): the router checks it is its own."""
        return code_id()

    async def warmup(self) -> int:
        """Run one short greedy request through the engine, so that the first request routed
        here does not pay for first-call allocations, then a few rounds of prompts alone of
        growing size (WARMUP_PROMPT_STEPS, up to the token budget), which teach the scheduler
        what such steps cost (engine/prompt_steps.py); their blocks are freed when they end.
        Returns the tokens the first produced."""
        vocab = self.engine.vocab_size
        prompt = [(7 * i + 1) % vocab for i in range(WARMUP_PROMPT_TOKENS)]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        try:
            return await self._warm(prompt, params)
        finally:
            # The router learns its step times from serving steps only: these ran first shapes
            # (slow once), beside the other workers' warm-ups. Nor do the totals it reports
            # (busy seconds, prefix-cache lookups) count them: a replacement's warm-up read as
            # seconds busy within one scrape (376% busy) and as lookups that hit nothing.
            await self.aeng.call(lambda e: e.reset_totals())

    async def _warm(self, prompt: list[int], params: SamplingParams) -> int:
        vocab = self.engine.vocab_size
        n = 0
        async for out in self.aeng.generate(prompt, params, f"warmup-{self.worker_id}"):
            n += len(out.new_token_ids)
        eng = self.engine
        largest = min(
            eng.config.scheduler.max_num_batched_tokens,  # one step each
            eng.max_model_len - 1,
            eng.kv.pool.num_blocks * eng.kv.block_size // 2,
        )
        sizes = [size for size in WARMUP_PROMPT_STEPS if size <= largest]
        one = replace(params, max_tokens=1)
        # The first request's steps ran first (slow once): they teach nothing.
        await self.aeng.call(lambda e: e.scheduler.prompt_steps.reset())
        for r in range(WARMUP_ROUNDS if len(sizes) > 1 else 0):
            for i, size in enumerate(sizes):
                # Distinct tokens from the first and from each other: nothing of them is cached.
                k = r * len(sizes) + i
                prompt = [(11 * j + 3 + k) % vocab for j in range(size)]
                async for _ in self.aeng.generate(prompt, one, f"warmup-{self.worker_id}-{k}"):
                    pass
        return n

    async def set_step_target(self, target_s: float | None, seq: int = 0) -> None:
        """The step target the router tunes from the gaps this worker's requests see (see
        Scheduler.set_step_target). `seq`: the router's number for the call, rising with each
        one it sends; Ray may run them out of order (ended.py), and one numbered below the
        latest taken is stale and changes nothing (0: unnumbered, always taken)."""
        if seq:
            if seq <= self._target_seq:
                return
            self._target_seq = seq  # before the await: the engine takes them in this order
        await self.aeng.call(lambda e: e.scheduler.set_step_target(target_s))

    async def generate(self, req: WorkRequest) -> AsyncIterator[TokenChunk]:
        """Colocated path: prefill here, then decode; one chunk per step."""
        if req.request_id in self.ended:
            yield TokenChunk.aborted(req.request_id, self.worker_id)
            return
        async for out in self.aeng.generate(
            req.prompt_token_ids, req.sampling, req.request_id, prefill_hold_s=req.prefill_hold_s
        ):
            yield TokenChunk.from_output(out, self.worker_id)

    def open_transfers(self) -> int:
        """KV transfers still tracked for this worker; a transfer side overrides it."""
        return 0

    async def ping(self) -> None:
        """Answered between two engine steps, as `load` is, but with nothing taken: a stream's
        hang watch asks it (router/worker_calls.py), and `load` drains the step stats that
        only the router's poll may take."""
        await self.aeng.call(lambda e: None)

    async def load(self) -> WorkerLoad:
        load = await self.aeng.call(lambda e: engine_load(e, self.worker_id, self.role))
        return replace(
            load, open_transfers=self.open_transfers(), incarnation=self._info.incarnation
        )

    def shutdown(self) -> None:
        self.aeng.shutdown()


def _actor_id() -> str:
    """The Ray actor id of this process's actor ("" outside an actor)."""
    import ray

    if not ray.is_initialized():
        return ""
    return ray.get_runtime_context().get_actor_id() or ""


def _node_id() -> str:
    """The Ray node id of this process's node ("" outside Ray)."""
    import ray

    if not ray.is_initialized():
        return ""
    return ray.get_runtime_context().get_node_id() or ""


def worker_info(
    engine: LLMEngine, worker_id: str, role: WorkerRole, rate: DeviceRate, **identity: Any
) -> WorkerInfo:
    """What the router needs to know of a worker; `identity` fills WorkerInfo's identity fields
    (incarnation, node_ip, kv_host, actor_id, pid)."""
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
        prefill_hold_s=engine.config.scheduler.prefill_hold_s,
        device=engine.runner.device.type,
        **identity,
    )


def engine_load(engine: LLMEngine, worker_id: str, role: WorkerRole) -> WorkerLoad:
    """A worker's load figures, read on the engine thread."""
    sched = engine.scheduler
    prefilling = list(sched.running_prefills())
    left = [
        (r.request_id, r.num_tokens - r.num_computed_tokens) for r in (*sched.waiting, *prefilling)
    ]
    # a running prefill's last token is computed with its first decode step
    queued = sum(n for _, n in left) - len(prefilling)
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
        prefills_left=tuple(left),
        held=len(sched.held),
        steps=engine.step_stats.drain(),
        preemptions=sched.num_preemptions,
        busy_s=engine.step_stats.busy_s,
        prefix_queries=pool.stats.queries,
        prefix_hits=pool.stats.hits,
        chunk_floor_s=sched.sizer.floor_s if sched.sizer else None,
        prompt_wait_steps=sched.num_held_steps,
        hold_left_s=sched.hold_left_s,
    )
