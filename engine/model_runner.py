"""Executes a SchedulerOutput on one device: flattens the batch, runs the model, samples.

Lifecycle per step: prepare inputs in the preallocated step buffers (decodes first, then prefill
chunks; one host-to-device copy, see engine/step_inputs.py) -> forward over the paged cache (a
decode-only step on CUDA: the replay of a captured graph, padded to its ladder size, see
engine/cuda_graphs.py) ->
sample the rows whose chunk ended its sequence, on the device -> one device-to-host copy of the
sampled ids -> ModelRunnerOutput. The runner keeps one torch.Generator (with its seed and count of
draws: engine/sampler.py) and one block-table row per live request, and drops both when the
scheduler reports the request finished (the row also when it is preempted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import torch

from engine import cuda_graphs, paged_attention_cpu
from engine.attention import AttentionBackend, SdpaAttention
from engine.config import EngineConfig, resolve_device
from engine.errors import KVCacheAllocationError
from engine.kv_cache import KVCache, KVCacheSpec
from engine.loader import model_dtype
from engine.model import PagedDecoderModel
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.sampler import Draws, prompt_logprobs, sample, sample_seed
from engine.sampling_params import SamplingParams
from engine.step_inputs import StepBatch, StepInputs
from engine.token_logprobs import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepShape:
    """The shape of one executed step: what a replay needs to redo the same work."""

    decode_context_lens: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]  # (tokens in the chunk, tokens already cached)
    num_sampled: int


def _max_len(hf_model: Any, config: EngineConfig) -> int:
    """The longest sequence a request may reach: sizes the step buffers' block tables."""
    nominal = int(getattr(hf_model.config, "max_position_embeddings", 0) or 4096)
    return min(nominal, config.model.max_model_len or nominal)


class ModelRunner:
    def __init__(self, hf_model: Any, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = model_dtype(config.model, self.device)
        self.model = PagedDecoderModel(hf_model, self.device, self.dtype)
        self.block_size = config.cache.block_size
        self.spec = KVCacheSpec(
            num_layers=self.model.num_layers,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )
        self.num_blocks = self._num_blocks()
        capture = self._graph_capture()
        # With graphs, one block past the pool's is the scratch block padded decode rows use
        # (kept even if the backend chosen next turns graphs off: one block).
        self.cache = self._allocate_cache(self.num_blocks + (capture is not None))
        self.attention = self._attention_backend(config.model.attention_backend)
        sc = config.scheduler
        self.inputs = StepInputs(
            self.device,
            self.block_size,
            max_tokens=sc.max_num_batched_tokens,
            max_seqs=sc.max_num_seqs,
            max_blocks_per_seq=min(
                self.num_blocks, -(-_max_len(hf_model, config) // self.block_size)
            ),
        )
        self.graphs: cuda_graphs.DecodeGraphs | None = None
        why = (
            cuda_graphs.unsupported_reason(self.model, self.attention)
            if capture is not None
            else None
        )
        if why is not None:
            log.warning("decode steps run eagerly: %s", why)
        elif capture is not None:
            self.inputs.scratch_block = self.num_blocks
            sizes = cuda_graphs.ladder(min(sc.max_num_seqs, self.inputs.max_tokens))
            graphs = cuda_graphs.DecodeGraphs(capture, sizes, self._padded_forward)
            if graphs.capture_all(self.inputs.generation):
                self.graphs = graphs
        self.draws: dict[str, Draws] = {}  # of each request that samples
        # When a list, every executed step's shape is appended (benchmarks replay them).
        self.trace: list[StepShape] | None = None
        self._seed_source = torch.Generator()  # of the requests that give no seed
        if config.model.sampling_seed is None:
            self._seed_source.seed()  # from the OS's randomness: each run samples anew
        else:
            self._seed_source.manual_seed(config.model.sampling_seed)

    def _graph_capture(self) -> cuda_graphs.Capture | None:
        if self.config.model.enforce_eager:
            return None
        return cuda_graphs.capturer(self.device)

    def _padded_forward(self, size: int) -> cuda_graphs.Forward:
        return cuda_graphs.forward_over(
            self.model, self.attention, self.inputs.padded_decodes(size)
        )

    def _attention_backend(self, name: str) -> AttentionBackend:
        heads, scale = self.model.num_heads, self.model.scale
        if name not in ("auto", "sdpa", "paged"):
            raise ValueError(f"attention_backend must be auto, sdpa or paged, got {name!r}")
        if name in ("auto", "paged") and self.device.type == "cuda" and find_spec("triton"):
            # Imported here: triton is optional on CPU installs (CUDA builds of torch bring it).
            from engine import triton_attention

            return triton_attention.TritonPagedAttention(self.cache, heads, scale)
        if name in ("auto", "paged") and paged_attention_cpu.supported(self.cache):
            lib = paged_attention_cpu.load_kernel()
            if lib is not None:
                return paged_attention_cpu.PagedCpuAttention(self.cache, heads, scale, lib)
        if name == "paged":
            raise ValueError(
                "attention_backend 'paged' needs triton on CUDA, or float32 on CPU and a C "
                "compiler to build its kernel"
            )
        return SdpaAttention(self.cache, heads, scale)

    def _allocate_cache(self, num_blocks: int) -> KVCache:
        try:
            return KVCache(self.spec, num_blocks, self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError included
            if not _out_of_memory(exc):
                raise
            cc = self.config.cache
            if cc.num_blocks is not None:
                asked = f"cache.num_blocks {cc.num_blocks}"
            elif self.device.type == "cuda":
                asked = cc.kv_budget_said(*self._gpu_memory())
            else:
                asked = f"cache.cpu_kv_cache_gib {cc.cpu_kv_cache_gib:g}"
            size = num_blocks * self.spec.bytes_per_block / (1 << 30)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise KVCacheAllocationError(
                f"the KV cache does not fit on {self.device}: {num_blocks} blocks, "
                f"{size:.1f} GiB, from {asked}; ask for less ({reason})"
            ) from exc

    def _num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_blocks is not None:
            return cc.num_blocks
        if self.device.type == "cuda":
            memory = self._gpu_memory()
            budget = cc.kv_budget_bytes(*memory)
            if budget < self.spec.bytes_per_block:
                said = cc.kv_budget_said(*memory)
                raise KVCacheAllocationError(f"no room for a KV cache on {self.device}: {said}")
            return self.spec.num_blocks_for_bytes(budget)
        return self.spec.num_blocks_for_bytes(cc.cpu_kv_cache_gib * (1 << 30))

    def _gpu_memory(self) -> tuple[int, int, int]:
        """The device's free and total bytes, and those this process's allocator holds."""
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total, torch.cuda.memory_reserved(self.device)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        """The generator of the request's next sample: seeded from its seed and that sample's
        number (sample_seed)."""
        if s.sampling.greedy:
            return None
        d = self._draws_for(s.request_id, s.sampling)
        d.generator.manual_seed(sample_seed(d.seed, d.drawn))
        d.drawn += 1
        return d.generator

    def _draws_for(self, request_id: str, sampling: SamplingParams) -> Draws:
        d = self.draws.get(request_id)
        if d is None:
            seed, drawn = sampling.seed, sampling.drawn
            if seed is None:  # a fresh seed: as good as any, past draws or not
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
                drawn = 0
            d = self.draws[request_id] = Draws(torch.Generator(device=self.device), seed, drawn)
        return d

    def skip_draws(self, request_id: str, sampling: SamplingParams, n: int) -> None:
        """Count `n` samples of the request as drawn elsewhere (the prefill side's first
        token): its next sample is the one after them."""
        if not sampling.greedy:
            self._draws_for(request_id, sampling).drawn += n

    def execute(
        self, so: SchedulerOutput, on_layer: Callable[[int], None] | None = None
    ) -> ModelRunnerOutput:
        """Run one step. `on_layer(i)` is called once layer i's new KV is in the cache."""
        for rid in so.finished_request_ids:
            self.draws.pop(rid, None)
            self.inputs.release(rid)
        for rid in so.preempted_request_ids:
            self.inputs.release(rid)  # recomputed later on new blocks
        if so.is_empty:
            return ModelRunnerOutput((), ())
        pad = None
        if (
            self.graphs is not None
            and on_layer is None
            and not so.prompt_rows
            and so.num_batched_tokens == len(so.scheduled)
        ):
            pad = self.graphs.size_for(len(so.scheduled))  # decode-only: a graph may run it
        batch = self.inputs.prepare(so, pad)
        if batch.padded_to is not None and self.graphs is not None:
            if self.graphs.stale(self.inputs.generation):
                if not self.graphs.capture_all(self.inputs.generation):
                    self.graphs, pad = None, None
                batch = self.inputs.prepare(so, pad)  # capturing overwrote the inputs
        if self.trace is not None:
            self.trace.append(_shape(batch))
        prompt_lps: tuple[tuple[str, tuple[TokenLogprobs, ...]], ...] = ()
        if batch.padded_to is not None and self.graphs is not None:
            logits = self.graphs.run(batch.padded_to)[: len(batch.samplers)]
        elif so.prompt_rows:
            rows, owners = _prompt_rows(batch)
            x = self.model.hidden(
                batch.input_ids, batch.positions, batch.md, self.attention, on_layer
            )
            logits = self.model.logits(x[batch.logit_rows])
            at = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
            # The prompt rows' logits a slice at a time: a long chunk's [rows, vocab] at once
            # would be the step's largest tensor.
            prompt_lps = prompt_logprobs(lambda a, b: self.model.logits(x[at[a:b]]), owners)
        else:
            logits = self.model.forward(
                batch.input_ids, batch.positions, batch.md, self.attention, batch.logit_rows,
                on_layer,
            )  # fmt: skip
        samplers = batch.samplers
        if prompt_lps and not samplers:
            return ModelRunnerOutput((), (), prompt_logprobs=prompt_lps)
        if not samplers:
            # Nothing is read back, so nothing waits for the device: without this a step that
            # only prefills would return once its kernels are launched, and its time (the
            # engine's StepStat: the router's step-time model, the busy seconds) would be the
            # launches', its device time landing on the next step that samples.
            settle(self.device)
            return ModelRunnerOutput((), ())
        tokens, lps = sample(
            logits,
            [s.sampling for s in samplers],
            [self._generator(s) for s in samplers],
            [s.seen for s in samplers],
        )
        return ModelRunnerOutput(
            request_ids=tuple(s.request_id for s in samplers),
            token_ids=tuple(tokens),
            logprobs=tuple(lps),
            prompt_logprobs=prompt_lps,
        )


def _prompt_rows(batch: StepBatch) -> tuple[list[int], list[tuple[ScheduledRequest, int]]]:
    """The batch's rows whose logits give prompt logprobs (ScheduledRequest.prompt_targets),
    and per request that has any, the request and how many rows are its own, in row order."""
    rows: list[int] = []
    owners: list[tuple[ScheduledRequest, int]] = []
    r = 0  # the batch's order: decodes, then chunks, each chunk's tokens in a run of rows
    for s in batch.order:
        if s.prompt_targets:
            first = r + s.prompt_from
            rows.extend(range(first, first + len(s.prompt_targets)))
            owners.append((s, len(s.prompt_targets)))
        r += len(s.token_ids)
    return rows, owners


def settle(device: torch.device) -> None:
    """Wait for the work queued on `device`'s current stream (CUDA; elsewhere it is done when
    it returns). The current stream only: KV sends on streams of their own go on."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _shape(batch: StepBatch) -> StepShape:
    nd = batch.md.num_decodes
    return StepShape(
        decode_context_lens=tuple(s.start_pos + 1 for s in batch.order[:nd]),
        prefills=tuple((len(s.token_ids), s.start_pos) for s in batch.order[nd:]),
        num_sampled=len(batch.samplers),
    )


def _out_of_memory(exc: RuntimeError) -> bool:
    """Whether an allocation failed for want of memory (CUDA's OutOfMemoryError, or the CPU
    allocator's refusal), not for another reason."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text
