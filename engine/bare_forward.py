"""The limit an engine is measured against: the same model math on the same step shapes, with
each request's KV in one contiguous buffer and nothing around it (no scheduler, no block tables,
no sampling beyond an argmax).

It replays a recorded list of StepShape. Rows of a step get consecutive buffer slots, so a decode
batch attends to a plain slice of the buffer; token values are arbitrary (the work does not
depend on them).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata
from engine.model import PagedDecoderModel
from engine.model_runner import StepShape


class ContiguousAttention:
    """Static per-slot KV buffers [slots, Hkv, max_len, D] per layer; SDPA over slices."""

    name = "contiguous"

    def __init__(self, model: PagedDecoderModel, slots: int, max_len: int) -> None:
        shape = (slots, model.num_kv_heads, max_len, model.head_dim)
        dev, dt = model.device, model.embed.dtype
        self.k = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(model.num_layers)]
        self.v = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(model.num_layers)]
        self.scale = model.scale
        self.step: StepShape | None = None
        self.slot_idx = torch.empty(0, dtype=torch.long)
        self.pos_idx = torch.empty(0, dtype=torch.long)
        self.mask: torch.Tensor | None = None

    def prepare(self, step: StepShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        self.step = step
        slots: list[int] = []
        pos: list[int] = []
        for i, c in enumerate(step.decode_context_lens):
            slots.append(i)
            pos.append(c - 1)
        nd = len(step.decode_context_lens)
        for j, (n, start) in enumerate(step.prefills):
            slots.extend([nd + j] * n)
            pos.extend(range(start, start + n))
        self.slot_idx = torch.tensor(slots, dtype=torch.long, device=device)
        self.pos_idx = torch.tensor(pos, dtype=torch.long, device=device)
        self.mask = None
        if nd:
            lens = torch.tensor(step.decode_context_lens, device=device)
            width = int(lens.max())
            if int(lens.min()) != width:
                self.mask = (torch.arange(width, device=device)[None, :] < lens[:, None])[
                    :, None, None, :
                ]
        return self.slot_idx, self.pos_idx

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        self.k[layer][self.slot_idx, :, self.pos_idx] = k
        self.v[layer][self.slot_idx, :, self.pos_idx] = v

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        assert self.step is not None
        parts = []
        lens = self.step.decode_context_lens
        nd = len(lens)
        if nd:
            w = max(lens)
            out = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2),
                self.k[layer][:nd, :, :w],
                self.v[layer][:nd, :, :w],
                attn_mask=self.mask,
                scale=self.scale,
                enable_gqa=True,
            )
            parts.append(out.squeeze(2))
        row = nd
        for j, (n, start) in enumerate(self.step.prefills):
            ctx = start + n
            qpos = torch.arange(start, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            out = F.scaled_dot_product_attention(
                q[row : row + n].transpose(0, 1).unsqueeze(0),
                self.k[layer][nd + j : nd + j + 1, :, :ctx],
                self.v[layer][nd + j : nd + j + 1, :, :ctx],
                attn_mask=None if start == 0 else mask,
                is_causal=start == 0,
                scale=self.scale,
                enable_gqa=True,
            )
            parts.append(out.squeeze(0).transpose(0, 1))
            row += n
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def replay(model: PagedDecoderModel, steps: list[StepShape]) -> float:
    """Run every step's forward (and an argmax over sampled rows); return seconds."""
    slots = max(len(s.decode_context_lens) + len(s.prefills) for s in steps)
    max_len = max(
        [c for s in steps for c in s.decode_context_lens]
        + [n + st for s in steps for n, st in s.prefills]
    )
    att = ContiguousAttention(model, slots, max_len)
    dev = model.device
    vocab = model.vocab_size
    empty_md = AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=0,
        decode_block_table=torch.empty(0, 0, dtype=torch.long),
        decode_context_lens=torch.empty(0, dtype=torch.int32),
        decode_mask=None,
        prefills=(),
    )
    t0 = time.perf_counter()
    for s in steps:
        _, pos = att.prepare(s, dev)
        ids = torch.randint(0, vocab, (pos.shape[0],), device=dev)
        rows = torch.arange(s.num_sampled, device=dev)  # which rows doesn't change the work
        logits = model.forward(ids, pos, empty_md, att, rows)
        logits.argmax(dim=-1).tolist()
    return time.perf_counter() - t0
