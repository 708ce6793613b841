"""The paged KV cache tensors: where every layer's keys and values live.

One tensor per layer, shape [num_blocks, 2, block_size, num_kv_heads, head_dim]:

    layer l:  ┌──────────── block 0 ────────────┐┌──────────── block 1 ────────────┐ ...
              │ K: slot 0 [Hkv x D] ... slot B-1 ││ K: slot 0 ...                   │
              │ V: slot 0 [Hkv x D] ... slot B-1 ││ V: slot 0 ...                   │
              └──────────────────────────────────┘└─────────────────────────────────┘

One block of one layer (its K and V for block_size tokens) is a single contiguous run of
2 * block_size * Hkv * D elements, so kv_transfer can send a block as one slice. Token t of a
request sits in block block_ids[t // block_size], slot t % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_bytes(self, nbytes: float) -> int:
        return max(1, int(nbytes // self.bytes_per_block))


class KVCacheSource(NamedTuple):
    """Which cache a transfer endpoint serves: its geometry, device, and the model filling it."""

    spec: KVCacheSpec
    device: torch.device
    model_name: str
    model_config_text: str  # the model config as JSON; layouts of different models never pair


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        """Store new tokens' K and V [T, Hkv, D] at (block, offset) slots."""
        cache = self.layers[layer]
        cache[blocks, 0, offsets] = k
        cache[blocks, 1, offsets] = v

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks in `block_table` [..., nb] as [..., nb * block_size, Hkv, D]."""
        cache = self.layers[layer]
        k = cache[:, 0][block_table]
        v = cache[:, 1][block_table]
        lead = block_table.shape[:-1]
        tail = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        return k.view(*lead, *tail), v.view(*lead, *tail)
