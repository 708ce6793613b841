"""The CUDA paged-attention backend: one Triton kernel launch per layer for the whole step.

Every row of the step (decodes and prefill chunks alike) is a query of some *sequence*: a decode
is a sequence of one query, a prefill chunk one of `num_tokens` queries. A sequence's queries are
its last `q_len` positions out of `ctx_len`, so query j sits at position ctx_len - q_len + j and
sees keys 0..that position (causal within the chunk, everything of its cached prefix). K/V are
read in place through the sequence's block table (layout in engine/kv_cache.py): nothing is
gathered into a contiguous copy.

The grid is (query tiles, kv heads). A tile is up to BLOCK_Q consecutive queries of one sequence
times the G = H / Hkv query heads sharing one kv head, packed into BLOCK_M rows
(row r: query r // G, head r % G), so grouped heads read each K/V tile once. A decode is one
tile; a chunk of n tokens is ceil(n / BLOCK_Q) tiles. Softmax is online (running max and sum in
float32), and a tile stops reading keys after the last position its latest query may see.

The per-step tables (sequences and one padded block table) come from the model runner's step
buffers, already on the device; the tile tables are derived from them on the device once per step
(the first time a layer asks), so a step copies nothing across beyond the runner's one copy.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.attention import AttentionMetadata, PrefillSegment, write_kv
from engine.kv_cache import KVCache


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    table_ptr,
    seq_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_tb,
    block_size,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    row0 = tl.load(seq_ptr + seq * 3)
    q_len = tl.load(seq_ptr + seq * 3 + 1)
    ctx = tl.load(seq_ptr + seq * 3 + 2)

    offs_m = tl.arange(0, BLOCK_M)
    tok = q0 + offs_m // G
    head = kvh * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (tok < q_len)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    rows = (row0 + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # Every row (padding rows too) sees key 0, so the running max is finite after the first
    # key tile and no row ever computes -inf - -inf.
    qpos = ctx - q_len + tok
    kv_end = ctx - q_len + tl.minimum(q0 + BLOCK_Q, q_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        blk = tl.load(table_row + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
        base = blk * stride_cb + (offs_n % block_size) * stride_cs + kvh * stride_ch
        k = tl.load(
            cache_ptr + base[None, :] + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [D_PAD, BLOCK_N]
        v = tl.load(
            cache_ptr + stride_ckv + base[:, None] + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, D_PAD]
        if IEEE:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = qk * scale_log2
        visible = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


class StepPlan(NamedTuple):
    """One step's launch tables, shared by every layer (int32 or int64 alike)."""

    seqs: torch.Tensor  # [S, 3]: first row, query count, context length (rows contiguous)
    table: torch.Tensor  # [S, max_nb] block ids (padded with block 0; rows may be strided)
    tile_seq: torch.Tensor  # [num_tiles]: which sequence a tile belongs to
    tile_q0: torch.Tensor  # [num_tiles]: its first query within that sequence
    block_m: int
    block_q: int


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


class TritonPagedAttention:
    """Stores new K/V with the cache's own write; attends every row in one kernel launch."""

    name = "triton"

    def __init__(
        self,
        cache: KVCache,
        num_heads: int,
        scale: float,
        block_m_decode: int = 16,
        block_m_prefill: int = 64,
        block_n: int = 64,
    ) -> None:
        spec = cache.spec
        if num_heads % spec.num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {spec.num_kv_heads}")
        self.cache = cache
        self.num_heads = num_heads
        self.scale = scale
        self.group = num_heads // spec.num_kv_heads
        # tl.dot needs every tile dimension >= 16; BLOCK_M must hold one query's whole group.
        self.block_m_decode = max(16, _pow2(block_m_decode), _pow2(self.group))
        self.block_m_prefill = max(16, _pow2(block_m_prefill), _pow2(self.group))
        self.block_n = max(16, _pow2(block_n))
        self.d_pad = max(16, _pow2(spec.head_dim))
        self._plan_for: AttentionMetadata | None = None
        self._plan: StepPlan | None = None
        self._iota = torch.arange(0)
        self._zeros = torch.zeros(0, dtype=torch.long)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        write_kv(self.cache, layer, k, v, md)

    def plan(self, md: AttentionMetadata) -> StepPlan:
        """The step's launch tables; built on the first layer's call, reused by the others."""
        if self._plan_for is md and self._plan is not None:
            return self._plan
        nd, segs = md.num_decodes, md.prefills
        block_m = self.block_m_prefill if segs else self.block_m_decode
        block_q = block_m // self.group
        if md.seq_info is not None and md.block_table is not None:
            # The model runner's step buffers: already on the device, nothing to build.
            seqs, table = md.seq_info, md.block_table
        else:
            seqs, table = self._tables(md)
        tile_seq, tile_q0 = self._tiles(seqs, nd, segs, block_q)
        self._plan = StepPlan(seqs, table, tile_seq, tile_q0, block_m, block_q)
        self._plan_for = md
        return self._plan

    @staticmethod
    def _tables(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence and block tables from metadata built without the runner's buffers."""
        dev = md.slot_blocks.device
        nd, segs = md.num_decodes, md.prefills
        seg_rows = [(s.row_start, s.num_tokens, s.start_pos + s.num_tokens) for s in segs]
        dec_rows = torch.arange(nd, dtype=torch.int32, device=dev)
        dec = torch.stack([dec_rows, torch.ones_like(dec_rows), md.decode_context_lens.int()], 1)
        seqs = torch.cat([dec, torch.tensor(seg_rows, dtype=torch.int32, device=dev).view(-1, 3)])
        tables = [md.decode_block_table.int()] if nd else []
        tables += [s.block_table.int().unsqueeze(0) for s in segs]
        width = max(t.shape[1] for t in tables)
        table = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables])
        return seqs.contiguous(), table.contiguous()

    def _tiles(
        self, seqs: torch.Tensor, nd: int, segs: tuple[PrefillSegment, ...], block_q: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which sequence each query tile belongs to and its first query: a decode is one tile
        at query 0, a chunk of n tokens ceil(n / block_q) tiles. Computed on the device from the
        sequence table (the host knows only the count), so no per-step copy goes across."""
        dev = seqs.device
        if self._iota.device != dev or self._iota.shape[0] < nd:
            self._iota = torch.arange(max(nd, 2 * self._iota.shape[0]), device=dev)
            self._zeros = torch.zeros_like(self._iota)
        dec_seq, dec_q0 = self._iota[:nd], self._zeros[:nd]
        if not segs:
            return dec_seq, dec_q0
        num_chunk_tiles = sum(-(-s.num_tokens // block_q) for s in segs)
        q_lens = seqs[nd:, 1].long()
        counts = (q_lens + block_q - 1) // block_q
        seg_ids = torch.arange(len(segs), device=dev)
        tile_seg = torch.repeat_interleave(seg_ids, counts, output_size=num_chunk_tiles)
        first = torch.cumsum(counts, 0) - counts
        q0 = (torch.arange(num_chunk_tiles, device=dev) - first[tile_seg]) * block_q
        return torch.cat([dec_seq, tile_seg + nd]), torch.cat([dec_q0, q0])

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (already in the cache) -> [T, H, D]."""
        plan = self.plan(md)
        q = q.contiguous()
        out = torch.empty_like(q)
        cache = self.cache.layers[layer]
        grid = (plan.tile_seq.shape[0], self.cache.spec.num_kv_heads)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            self._launch(grid, q, out, cache, plan)
        return out

    def _launch(
        self,
        grid: tuple[int, int],
        q: torch.Tensor,
        out: torch.Tensor,
        cache: torch.Tensor,
        plan: StepPlan,
    ) -> None:
        spec = self.cache.spec
        _paged_attention_kernel[grid](
            q,
            out,
            cache,
            plan.table,
            plan.seqs,
            plan.tile_seq,
            plan.tile_q0,
            self.scale * math.log2(math.e),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            cache.stride(3),
            plan.table.stride(0),
            spec.block_size,
            G=self.group,
            HEAD_DIM=spec.head_dim,
            D_PAD=self.d_pad,
            BLOCK_M=plan.block_m,
            BLOCK_Q=plan.block_q,
            BLOCK_N=self.block_n,
            IEEE=q.dtype == torch.float32,
        )


def supported(cache: KVCache) -> bool:
    """The kernel runs on CUDA tensors in any float dtype the cache holds."""
    return cache.layers[0].device.type == "cuda"
