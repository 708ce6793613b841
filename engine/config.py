"""Frozen configuration for one engine process, built once and passed down.

Nothing below this module reads environment variables or flags: every knob lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.dtype_names import DTYPE_CHOICES, DTYPE_NAMES
from engine.sampling_params import is_seed

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
ATTENTION_BACKENDS = ("auto", "sdpa", "paged")


def resolve_device(name: str) -> torch.device:
    """A ModelConfig.device as the device it stands for in this process."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(
    requested: str, device: torch.device | str, checkpoint_dtype: Callable[[], str]
) -> torch.dtype:
    """The dtype an engine runs in on `device`.

    `auto` is resolved where the engine is built, on the device it runs on: a router on a CPU
    node must not decide for GPU workers. On CUDA it is the checkpoint's own dtype
    (`checkpoint_dtype()`, read only then). Anywhere else float32: on CPUs without half-precision
    units half precision is slower (a 3072x576 linear over 64 rows: 25 ms in bfloat16, 4.5 ms in
    float32 on the AVX2 machine this was written on), and the paged CPU kernel is float32-only.
    """
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    if requested != "auto":
        return DTYPES[requested]
    if torch.device(device).type != "cuda":
        return torch.float32
    declared = checkpoint_dtype()
    if declared not in DTYPES:
        raise ValueError(f"checkpoint dtype must be one of {sorted(DTYPES)}, got {declared!r}")
    return DTYPES[declared]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model, on which device, in which dtype."""

    model: str = "smollm2-135m"
    # One of DTYPE_CHOICES. "auto" (the command line's default) stays "auto" here and is resolved
    # by the process that builds the engine (engine.loader.model_dtype), where the device is
    # known. The library default stays float32, which tests compare against transformers in.
    dtype: str = "float32"
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    seed: int = 0  # of a tiny model's weights (engine/tiny_models.py)
    # The seeds of requests that give none: None draws them from the OS's randomness (each run
    # samples anew); an integer makes them repeat from run to run.
    sampling_seed: int | None = None
    # Upper bound on prompt + output tokens; None takes the model's own limit.
    max_model_len: int | None = None
    # torch threads for this process; None leaves torch's default.
    num_threads: int | None = None
    # Attention kernel: "auto", "sdpa" (portable gather + SDPA) or "paged" (the Triton
    # kernel on CUDA; the compiled CPU paged-decode kernel on CPU, when it builds).
    attention_backend: str = "auto"
    # Where converted models are cached; None means ~/.cache/pdserve/models.
    cache_dir: str | None = None
    # No CUDA graphs: every decode step runs eagerly (engine/cuda_graphs.py). CPU runs are
    # always eager.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.sampling_seed is not None and not is_seed(self.sampling_seed):
            raise ValueError(
                f"sampling_seed must be an integer in [0, 2**64), got {self.sampling_seed!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype given explicitly; `auto` has none until resolved on a device."""
        if self.dtype == "auto":
            raise ValueError(
                "dtype 'auto' depends on the device and the checkpoint: resolve it with "
                "engine.loader.model_dtype"
            )
        return DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry. Either a block count or a memory budget sizes it."""

    block_size: int = 16
    num_blocks: int | None = None
    # Fraction of free device memory for the KV cache on CUDA.
    gpu_memory_fraction: float = 0.8
    # The fraction of its device this engine's process may hold (below 1 where processes share
    # a GPU): see kv_budget_bytes.
    gpu_share: float = 1.0
    # KV cache size on CPU, in GiB, when num_blocks is not given.
    cpu_kv_cache_gib: float = 2.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if not 0.0 < self.gpu_share <= 1.0:
            raise ValueError(f"gpu_share must be in (0, 1], got {self.gpu_share}")

    def kv_budget_bytes(self, free: int, total: int, held: int) -> float:
        """The KV cache's bytes on a GPU with `free` of `total` bytes free, `held` of them by
        this process already (its weights, what torch's allocator keeps): gpu_memory_fraction of
        what is free; with a gpu_share below 1, no more than that fraction of its share of the
        device less what it holds, which leaves the rest of the share (activations, graphs, the
        CUDA context) whatever the weights take. Processes that share a GPU and start together
        each get their share, whichever reads the free memory first: the free memory alone would
        give the first most of the device and the next what is left, or both the same free
        memory, too much for the two."""
        f = self.gpu_memory_fraction
        room = free * f
        if self.gpu_share < 1:
            room = min(room, f * self.gpu_share * total - held)
        return max(0.0, room)

    def kv_budget_said(self, free: int, total: int, held: int) -> str:
        """How kv_budget_bytes came to its figure, the bound that set it and the settings that
        move it, for an error that must say why the cache is that size."""
        gib, f = 1 << 30, self.gpu_memory_fraction
        share = f * self.gpu_share * total
        if self.gpu_share < 1 and share - held < free * f:
            return (
                f"cache.gpu_memory_fraction {f:g} of this process's cache.gpu_share "
                f"{self.gpu_share:g} of {total / gib:.1f} GiB is {share / gib:.1f} GiB, less the "
                f"{held / gib:.1f} GiB it holds (its weights): a larger share or a smaller model "
                "makes room"
            )
        others = max(0, total - free - held)
        return (
            f"cache.gpu_memory_fraction {f:g} of the {free / gib:.1f} GiB free of "
            f"{total / gib:.1f} GiB (this process holds {held / gib:.1f} GiB, others "
            f"{others / gib:.1f} GiB)"
        )


# With a step target, the fewest prefill tokens a step next to decodes takes: every prompt
# advances, even where the decodes alone take longer than the target.
MIN_CHUNK = 16


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """One token budget per step, shared by decodes (first) and prefill chunks (after)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # While requests are decoding, size each step's prefill chunk so that the step takes about
    # this long (learned from the steps just run; see Scheduler.observe_step), down to MIN_CHUNK
    # tokens: long prompts then stretch the running requests' steps to about this, not to a
    # whole budget's worth of prefill. Chunked prefill only. None: the token budget alone.
    step_target_s: float | None = None
    # With a step target: where even a MIN_CHUNK chunk beside the running decodes took a step
    # past the target (the slowest of the latest such steps its sizer measured), prompts wait
    # for them, while they will all have ended (at max_tokens) within what is left of this many
    # seconds to each prompt in line: their steps stay decode-only, and the prompts run after
    # them at the whole budget. A prompt that waited this long in all is chunked beside decodes
    # as before. A request may bring its own (Request.prefill_hold_s: the router derives it
    # from its TTFT SLO), which this is the default for. None (or 0): prompts never wait;
    # without a step target it does nothing.
    prefill_hold_s: float | None = None

    def __post_init__(self) -> None:
        if self.step_target_s is not None and not self.step_target_s > 0:
            raise ValueError(f"step_target_s must be > 0, got {self.step_target_s}")
        if self.prefill_hold_s is not None and not 0 <= self.prefill_hold_s < float("inf"):
            raise ValueError(f"prefill_hold_s must be finite and >= 0, got {self.prefill_hold_s}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            # Otherwise every step's decodes can't all fit the budget and the last ones starve.
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Text deltas in every output. Off, a request's text is decoded only where a stop string
    # must be found in it: the workers run so, since the router detokenizes what they stream.
    detokenize: bool = True
