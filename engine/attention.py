"""Attention over the paged KV cache for one step's flattened batch.

Rows of a step are ordered: single-token queries first (decodes, batched together), then
multi-token chunks (prefills), each attending to its own request's blocks. Keys are written to the
cache before attention runs, so a chunk sees its own tokens and everything computed before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    row_start: int
    num_tokens: int
    start_pos: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [nb] long, covering start_pos + num_tokens


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] long
    slot_offsets: torch.Tensor  # [T] long
    num_decodes: int  # rows [0, num_decodes) are single-token queries
    decode_block_table: torch.Tensor  # [num_decodes, max_nb] long (padded with block 0)
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_nb * bs] bool; None if no padding
    prefills: tuple[PrefillSegment, ...]


class AttentionBackend(Protocol):
    """Stores a layer's new keys/values, then attends every row of the step."""

    name: str

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> None: ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor: ...


class SdpaAttention:
    """Portable backend: gather a request's blocks, then torch SDPA (any device, any dtype)."""

    name = "sdpa"

    def __init__(self, cache: KVCache, num_heads: int, scale: float) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.scale = scale

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        self.cache.write(layer, k, v, md.slot_blocks, md.slot_offsets)

    def decode(self, layer: int, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D]."""
        k, v = self.cache.gather(layer, md.decode_block_table)  # [Bd, L, Hkv, D]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=md.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        seg: PrefillSegment,
    ) -> torch.Tensor:
        """q [n, H, D] for one chunk -> [n, H, D]."""
        if seg.start_pos == 0:
            # Nothing cached before the chunk: its own keys are all there is.
            k, v = k_new, v_new
            mask = None
            causal = True
        else:
            k, v = self.cache.gather(layer, seg.block_table)
            ctx = seg.start_pos + seg.num_tokens
            k, v = k[:ctx], v[:ctx]
            qpos = torch.arange(seg.start_pos, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (already in the cache) -> [T, H, D]."""
        parts = []
        nd = md.num_decodes
        if nd:
            parts.append(self.decode(layer, q[:nd], md))
        for seg in md.prefills:
            rows = slice(seg.row_start, seg.row_start + seg.num_tokens)
            parts.append(self.prefill(layer, q[rows], k[rows], v[rows], seg))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
