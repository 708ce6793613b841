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
    """One step's attention inputs. The model runner's are views into its preallocated step
    buffers (engine/step_inputs.py); tests may build their own and leave the optional ones out.
    Block tables may be views with a row stride wider than their width."""

    slot_blocks: torch.Tensor  # [T] long
    slot_offsets: torch.Tensor  # [T] long
    num_decodes: int  # rows [0, num_decodes) are single-token queries
    decode_block_table: torch.Tensor  # [num_decodes, max_nb] long (padded with block 0)
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    # [num_decodes, 1, 1, max_nb * bs] bool; None: derived from the context lengths by the
    # backend that needs it (only SDPA does)
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillSegment, ...]
    # Rows of each new token's K (row 0) and V (row 1) in a layer viewed as
    # [num_blocks * 2 * block_size, Hkv, D]: one index_copy_ per tensor, not a 2-index scatter.
    kv_slots: torch.Tensor | None = None  # [2, T] long
    # Every sequence of the step (decodes, then chunks): first row, query count, context length.
    seq_info: torch.Tensor | None = None  # [S, 3] long
    block_table: torch.Tensor | None = None  # [S, max_nb] long, all sequences, step order
    context_lens: torch.Tensor | None = None  # [S] int32


def write_kv(
    cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
) -> None:
    """Store a layer's new K and V [T, Hkv, D] at the step's slots."""
    if md.kv_slots is None:
        cache.write(layer, k, v, md.slot_blocks, md.slot_offsets)
        return
    t = cache.layers[layer]
    flat = t.view(-1, t.shape[-2], t.shape[-1])
    flat.index_copy_(0, md.kv_slots[0], k)
    flat.index_copy_(0, md.kv_slots[1], v)


def decode_mask(md: AttentionMetadata, block_size: int) -> torch.Tensor | None:
    """The decode rows' key mask over their padded block tables (True: a key to attend)."""
    if md.decode_mask is not None or not md.num_decodes:
        return md.decode_mask
    width = md.decode_block_table.shape[1] * block_size
    keys = torch.arange(width, device=md.decode_context_lens.device)
    return (keys[None, :] < md.decode_context_lens[:, None])[:, None, None, :]


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
        # The decode mask is derived once per step, on the first layer's call.
        self._mask_for: AttentionMetadata | None = None
        self._mask: torch.Tensor | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        write_kv(self.cache, layer, k, v, md)

    def decode(self, layer: int, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D]."""
        if self._mask_for is not md:
            self._mask = decode_mask(md, self.cache.spec.block_size)
            self._mask_for = md
        k, v = self.cache.gather(layer, md.decode_block_table)  # [Bd, L, Hkv, D]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=self._mask,
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
