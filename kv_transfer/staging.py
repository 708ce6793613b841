"""Staging buffers between a paged cache and the wire, two slots per lane end.

A layer's blocks are not contiguous in the cache (block ids are arbitrary), but the wire wants one
tensor per message: the sender gathers `layer[src_ids]` of one or more consecutive layers into a
staging slot (layer-major), the receiver lands the message in a slot and scatters each layer's part
into `layer[dst_ids]`. Two slots let the copy of one message overlap the wire time of the next.
Slots are kept and grown, never reallocated per message: fresh pages per message cost as much as
the copy itself.

Where the ids of one side form a single ascending run `a..a+n-1`, that side skips its copy: one
layer's blocks are then the contiguous slice `layer[a:a+n]`, byte for byte the message a gather
would build, so it is sent from or received into the cache itself (`direct`, one layer per
message). Each side decides alone; the wire carries the same bytes either way.

Where the tensors live:
  - cache on CPU: everything on CPU (gloo);
  - cache on CUDA with nccl: slots on the cache's device, copies on a side stream;
  - cache on CUDA with gloo (both ends on one GPU, where NCCL refuses two ranks; the other end on
    CPU; or gloo asked for): gathered on the device,
    then moved through pinned host memory, since gloo point-to-point carries host tensors. No
    direct messages here: the cache is not on the wire's device.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.wire import HEADER_LEN

SLOTS = 2


class Staging:
    """One per lane end. A slot is used by one thread at a time; the owner hands slots over
    (sender: gather then send; receiver: land then scatter). A tensor returned for a slot stays
    valid until that slot is used again."""

    def __init__(self, layout: KVLayout, device: torch.device, backend: str) -> None:
        self.layout = layout
        self.device = device
        # Tensors handed to the process group live on the wire device.
        self.wire_device = device if backend == "nccl" else torch.device("cpu")
        # The cache's own tensors can go on the wire (CPU with gloo, CUDA with nccl).
        self.direct = self.wire_device == device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._dev: list[torch.Tensor | None] = [None] * SLOTS  # on `device`
        self._host: list[torch.Tensor | None] = [None] * SLOTS  # only for cuda + gloo
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.wire_device)

    def _slot(
        self, bufs: list[torch.Tensor | None], slot: int, n: int, device: torch.device
    ) -> torch.Tensor:
        """The first `n` block-layers of slot `slot` in `bufs`, growing it when too small."""
        buf = bufs[slot]
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(
                (n, *self.layout.block_shape),
                dtype=self.layout.torch_dtype,
                device=device,
                pin_memory=device.type == "cpu" and self.device.type == "cuda",
            )
            bufs[slot] = buf
        return buf[:n]

    def on_stream(self) -> AbstractContextManager[object]:
        """Run device work on the side stream (a no-op on CPU)."""
        if self.stream is None:
            return nullcontext()
        return torch.cuda.stream(self.stream)

    def wait_ready(self, ready: list[torch.cuda.Event]) -> None:
        """Make the side stream wait for the producer's writes (a no-op on CPU)."""
        if self.stream is not None:
            for event in ready:
                self.stream.wait_event(event)

    def sync(self) -> None:
        """Wait for the side stream's work, e.g. a recv straight into the cache (no-op on CPU)."""
        if self.stream is not None:
            self.stream.synchronize()

    def gather(
        self,
        slot: int,
        layers: list[torch.Tensor],
        index: torch.Tensor,
        ready: list[torch.cuda.Event],
    ) -> torch.Tensor:
        """`[layer[index] for layer in layers]` as one contiguous wire tensor, layer-major.
        `ready` marks the producer's writes of these layers on its own streams. Returns once
        the source blocks have been read."""
        n = index.shape[0]
        out = self._slot(self._dev, slot, n * len(layers), self.device)
        with self.on_stream():
            self.wait_ready(ready)
            for j, layer in enumerate(layers):
                torch.index_select(layer, 0, index, out=out[j * n : (j + 1) * n])
            if self.wire_device != self.device:
                host = self._slot(self._host, slot, out.shape[0], self.wire_device)
                host.copy_(out, non_blocking=True)
                out = host
        if self.stream is not None:
            self.stream.synchronize()  # the owner may free the source blocks once we return
        return out

    def landing(self, slot: int, block_layers: int) -> torch.Tensor:
        """A wire tensor in slot `slot` for an incoming message of `block_layers` block-layers."""
        if self.wire_device == self.device:
            return self._slot(self._dev, slot, block_layers, self.device)
        return self._slot(self._host, slot, block_layers, self.wire_device)

    def scatter(
        self, slot: int, landed: torch.Tensor, layers: list[torch.Tensor], index: torch.Tensor
    ) -> None:
        """`layer[index] =` its part of `landed` (layer-major) for each layer; complete (visible
        to any stream) on return."""
        n = index.shape[0]
        with self.on_stream():
            if landed.device != self.device:
                dev = self._slot(self._dev, slot, landed.shape[0], self.device)
                dev.copy_(landed, non_blocking=True)
                landed = dev
            for j, layer in enumerate(layers):
                layer.index_copy_(0, index, landed[j * n : (j + 1) * n])
        if self.stream is not None:
            self.stream.synchronize()
