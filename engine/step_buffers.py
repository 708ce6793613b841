"""The preallocated buffers a step's inputs are written into, and their one copy to the device
(engine/step_inputs.py builds StepInputs on this and fills them each step).

Every per-step tensor the forward reads lives in one flat int64 staging buffer, carved into fixed
regions (the decode part of each region always starts at offset 0, so a decode-only step's inputs
sit at the same addresses from step to step):

    ┌ input_ids [T] ┬ positions [T] ┬ slot_blocks [T] ┬ slot_offsets [T] ┬ kv_slots [2, T] ┬
    ├ logit_rows [S] ┬ seq_info [S, 3] ┬ context_lens [S] int32 (S/2 int64 words) ┬
    └ block_table [S, W] (last: a step copies only its first rows) ┘

T is the most tokens a step may hold, S the most sequences, W the most blocks one sequence may
hold. On CUDA the staging buffer is pinned host memory with a twin on the device, and one
non-blocking copy per step moves the used prefix across (two host buffers alternate, so a step
may be prepared while the previous copy is still in flight). On CPU the host buffer is the device
buffer: nothing is copied at all. A step that outgrows them reallocates them all, larger, and
bumps `generation`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch


class Regions(NamedTuple):
    """Where each input lives: slices of the flat buffer, or the device tensors themselves."""

    ids: Any
    pos: Any
    blocks: Any
    offsets: Any
    kv_slots: Any
    logit_rows: Any
    seq_info: Any
    ctx: Any  # int64 words holding S int32 context lengths
    table: Any


def _regions(max_tokens: int, max_seqs: int, width: int) -> Regions:
    sizes = [max_tokens] * 4 + [
        2 * max_tokens,
        max_seqs,
        3 * max_seqs,
        (max_seqs + 1) // 2,
        max_seqs * width,
    ]
    cuts = np.cumsum([0, *sizes]).tolist()
    return Regions(*(slice(a, b) for a, b in zip(cuts, cuts[1:])))


class StepBuffers:
    """The staging buffers, host and device, with each region's views on both sides."""

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, width: int) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        # Bumped whenever the buffers are reallocated: captured decode graphs read the old ones.
        self.generation = 0
        self._allocate(max_tokens, max_seqs, width)

    def _allocate(self, max_tokens: int, max_seqs: int, width: int) -> None:
        self.generation += 1
        self.max_tokens, self.max_seqs, self.width = max_tokens, max_seqs, width
        self.regions = _regions(max_tokens, max_seqs, width)
        n = self.regions.table.stop
        count = 2 if self.pinned else 1
        self._hosts = [
            torch.zeros(n, dtype=torch.long, pin_memory=self.pinned) for _ in range(count)
        ]
        # On CUDA, one event per host buffer, recorded after its copy went out: a host buffer is
        # written again only once its last copy has completed (a step that samples nothing does
        # not synchronise on its own).
        self._copied = [torch.cuda.Event() for _ in self._hosts] if self.pinned else []
        rg = self.regions
        self._host_regions = []
        for host in self._hosts:
            h = host.numpy()
            self._host_regions.append(
                Regions(
                    h[rg.ids],
                    h[rg.pos],
                    h[rg.blocks],
                    h[rg.offsets],
                    h[rg.kv_slots].reshape(2, max_tokens),
                    h[rg.logit_rows],
                    h[rg.seq_info].reshape(max_seqs, 3),
                    h[rg.ctx].view(np.int32),
                    h[rg.table].reshape(max_seqs, width),
                )  # fmt: skip
            )
        self._dev = (
            torch.zeros(n, dtype=torch.long, device=self.device) if self.pinned else self._hosts[0]
        )
        self._turn = 0
        d = self._dev
        self._dev_regions = Regions(
            d[rg.ids], d[rg.pos], d[rg.blocks], d[rg.offsets], d[rg.kv_slots].view(2, max_tokens),
            d[rg.logit_rows], d[rg.seq_info].view(max_seqs, 3), d[rg.ctx].view(torch.int32),
            d[rg.table].view(max_seqs, width),
        )  # fmt: skip

    def _ensure(self, tokens: int, seqs: int, width: int) -> bool:
        """Grow the staging buffers when a step outgrows them (an unchunked long prompt, a
        sequence longer than the model's nominal context): rare, and never on a decode step
        that fits the configured limits. True where they grew."""
        if tokens <= self.max_tokens and seqs <= self.max_seqs and width <= self.width:
            return False

        def grow(need: int, have: int) -> int:
            return have if need <= have else max(need, 2 * have)

        self._allocate(
            grow(tokens, self.max_tokens), grow(seqs, self.max_seqs), grow(width, self.width)
        )
        return True

    def _next_host(self) -> Regions:
        """The host buffer whose turn it is, once its last copy has completed."""
        self._turn = (self._turn + 1) % len(self._hosts)
        if self._copied:
            self._copied[self._turn].synchronize()
        return self._host_regions[self._turn]

    def _all_hosts(self) -> list[Regions]:
        """Every host buffer, once all their copies have completed."""
        for event in self._copied:
            event.synchronize()
        return self._host_regions

    def _copy_to_device(self, used: int) -> None:
        """The one host-to-device copy of the step (none on CPU)."""
        if self.pinned:
            self._dev[:used].copy_(self._hosts[self._turn][:used], non_blocking=True)
            # On the stream the copy went to (its device's, which need not be the current one).
            self._copied[self._turn].record(torch.cuda.current_stream(self._dev.device))
