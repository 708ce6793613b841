"""CUDA graphs for decode-only steps: one graph per padded batch size, replayed from static inputs.

A decode-only step (every scheduled request computes one token) runs as a replay of the graph
captured for the smallest ladder size B >= its batch. Its inputs are the runner's step buffers
(engine/step_inputs.py), whose decode rows sit at the same device addresses every step; the rows
from the batch up to B are padding: token 0 at position 0, writing its K/V into one scratch block
that no request ever holds, attending only to that block. The graph covers the whole forward up
to the logits of all B rows; sampling runs after it, eagerly, on the first `batch` rows.

Mixed steps (prefill chunks beside decodes), steps with a per-layer hook (a prefill worker
streaming KV), and batches above the largest size run eagerly: their shapes vary with every
chunk, and a prefill step is long enough for its launches not to matter.

Ladder: 1, 2, 4, then multiples of 8 up to the scheduler's max_num_seqs (and that number itself).
Graphs are captured largest first, sharing one memory pool, when the runner starts; if the step
buffers are ever reallocated (a step outgrew them: an unchunked prompt longer than the budget),
every graph is captured again before the next replay, running decodes waiting for it. A capture
that fails leaves the engine eager, with a logged error. The backend must read a row's blocks only
up to its context length (Triton on CUDA; the CPU kernel): the SDPA backend runs eagerly. The
logits of all B rows are a graph output: each size keeps its own [B, vocab] tensor.
`--enforce-eager` turns graphs off; a prefill worker never captures (its steps stream KV per
layer).

The capture itself is a strategy: `CudaCapture` on CUDA; `EagerReplay` reruns the captured
function instead, which lets the CPU test suite check the padding, the scratch block and the
static-buffer discipline (a replay reads nothing but the buffers) without a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]


class Captured(Protocol):
    def replay(self) -> torch.Tensor:
        """Run the captured step again on the buffers' current contents; its logits."""
        ...


class Capture(Protocol):
    def capture(self, fn: Forward) -> Captured: ...


class _Graph:
    def __init__(self, graph: Any, out: torch.Tensor) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


_pause_lock = threading.Lock()
_pauses = 0  # collector_paused blocks open now, in any thread
_was_enabled = False  # whether the collector ran before the first of them


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's automatic garbage collection off for the block, back as it was once the last
    such block open (in any thread) ends.

    A collection can start at any Python allocation, the captured forward's own included. One
    that frees CUDA objects during a capture (graphs and their memory pool, tensors, held in a
    reference cycle that became garbage) would invalidate the capture, or make CUDA refuse a call
    inside a destructor and abort the process. Garbage made during the block is collected after
    it."""
    global _pauses, _was_enabled
    with _pause_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()


class CudaCapture:
    """torch.cuda.CUDAGraph capture: warm up on a side stream, capture into a shared pool.

    Capture is thread-local: a worker's KV transfer threads keep using CUDA (their own streams,
    synchronisations, NCCL) while the engine thread captures. The garbage collector is paused
    while a graph is captured (`collector_paused`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(device):
            self.side = torch.cuda.Stream()  # one: cuBLAS keeps a workspace per stream

    def capture(self, fn: Forward) -> Captured:
        with torch.cuda.device(self.device):
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                for _ in range(2):  # first calls compile kernels and allocate workspaces
                    fn()
            torch.cuda.current_stream().wait_stream(self.side)
            graph = torch.cuda.CUDAGraph()
            with (
                collector_paused(),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
            ):
                out = fn()
            torch.cuda.synchronize(self.device)
        return _Graph(graph, out)


class _Rerun:
    def __init__(self, fn: Forward) -> None:
        self.fn = fn

    def replay(self) -> torch.Tensor:
        return self.fn()


class EagerReplay:
    """Runs the captured function again at every replay: the same static inputs and padding as a
    graph, without CUDA."""

    def capture(self, fn: Forward) -> Captured:
        fn()
        return _Rerun(fn)


def capturer(device: torch.device) -> Capture | None:
    """The capture strategy for a device: CUDA graphs on CUDA, none elsewhere."""
    return CudaCapture(device) if device.type == "cuda" else None


def ladder(max_seqs: int) -> list[int]:
    """The padded batch sizes captured, ascending."""
    sizes = {s for s in (1, 2, 4) if s <= max_seqs}
    sizes.update(range(8, max_seqs + 1, 8))
    sizes.add(max_seqs)
    return sorted(sizes)


# Backends whose decode reads a row's blocks up to its context length only: a graph's block table
# spans the buffers' whole width (the SDPA backend would gather every column of it).
GRAPH_BACKENDS = frozenset({"triton", "paged-cpu"})


def unsupported_reason(model: Any, attention: Any) -> str | None:
    """Why this model's forward cannot be captured, or None. RoPE variants that rescale with the
    longest position seen so far ("dynamic", "longrope") read it on the host every step."""
    rope = getattr(model.rotary, "rope_type", "default")
    if rope in ("dynamic", "longrope"):
        return f"rope_type {rope!r} reads the positions on the host"
    if attention.name not in GRAPH_BACKENDS:
        return f"the {attention.name} attention backend reads whole block tables"
    return None


class DecodeGraphs:
    """The captured decode steps of one runner, by padded batch size."""

    def __init__(self, capture: Capture, sizes: list[int], build: Callable[[int], Forward]):
        """`build(B)`, a method of the runner that holds these graphs, fills the step buffers'
        first B decode rows with padding and returns the forward over them (reading nothing
        but the buffers). It is held weakly: a cycle between the runner and its graphs would
        keep a dead runner's model and KV cache (GPU memory) until a garbage collection."""
        self.capture_with = capture
        self.sizes = sizes
        self._build = weakref.WeakMethod(build)
        self.graphs: dict[int, Captured] = {}
        self.generation = -1  # the step buffers' generation the graphs were captured on
        self.captures = 0  # times the whole ladder was captured
        self.replays: dict[int, int] = dict.fromkeys(sizes, 0)  # by size

    def build(self, size: int) -> Forward:
        """The padded forward of `size` rows, from the runner's buffers."""
        build = self._build()
        if build is None:
            raise RuntimeError("the runner these decode graphs belong to is gone")
        return build(size)

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size holding `batch` rows; None past the largest."""
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    def capture_all(self, generation: int) -> bool:
        """Capture every size; False (and no graphs: decode steps run eagerly from then on) if a
        capture failed."""
        self.graphs = {}
        try:
            # Largest first: later ones reuse its pool memory, and any per-batch scratch a
            # backend keeps (the Triton tile tables) is sized once, before any capture reads it.
            for size in reversed(self.sizes):
                self.graphs[size] = self.capture_with.capture(self.build(size))
        except Exception:
            log.exception("capturing decode graphs failed; decode steps run eagerly")
            self.graphs = {}
            return False
        self.generation = generation
        self.captures += 1
        log.info("captured decode graphs for batch sizes %s", self.sizes)
        return True

    def stale(self, generation: int) -> bool:
        """Whether the step buffers were reallocated since the capture: the graphs read the old
        addresses and must be captured again (which fills the buffers with padding: capture
        before preparing a step's inputs)."""
        return generation != self.generation

    def run(self, size: int) -> torch.Tensor:
        """Replay the graph of `size` (its inputs already in the buffers): logits [size, V]."""
        self.replays[size] += 1
        return self.graphs[size].replay()


def forward_over(model: Any, attention: Any, batch: Any) -> Forward:
    """The forward of a padded decode batch. The metadata is copied at each call, so that a
    backend's per-step caches (keyed by the metadata object) are rebuilt on every eager rerun,
    as a graph replay recomputes them."""

    def fn() -> torch.Tensor:
        md = copy.copy(batch.md)
        return model.forward(batch.input_ids, batch.positions, md, attention, batch.logit_rows)

    return fn
