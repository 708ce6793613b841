"""A step's inputs, prepared in preallocated buffers: O(scheduled requests) host work per step.

A step writes its tensors, decodes first, into the regions of the flat staging buffer drawn in
engine/step_buffers.py, so a decode-only step's inputs sit at the same addresses from step to
step; one copy moves them to the device (none on CPU).

Block tables are kept per request in a persistent host table (one row per live request): a step
appends only the blocks a request gained since its previous step, and a request's row is freed
when the scheduler reports it finished or preempted. The step's own table is then one gather of
the scheduled rows (in C), never rebuilt from Python lists. Positions, slots and the per-sequence
table are filled with numpy slice assignments, so the Python work of a step is one short pass
over its scheduled requests, whatever their lengths.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.attention import AttentionMetadata, PrefillSegment
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.step_buffers import Regions, StepBuffers


class StepBatch(NamedTuple):
    """One step's device inputs, views into the preallocated buffers (valid for this step)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    logit_rows: torch.Tensor  # [num sampled] long: rows whose logits are sampled
    md: AttentionMetadata
    order: list[ScheduledRequest]  # decodes first, then chunks: the row order of the step
    samplers: list[ScheduledRequest]  # the requests sampled this step, in row order
    padded_to: int | None = None  # rows in the buffers, padding included, when padded


class StepInputs(StepBuffers):
    """The runner's preallocated step inputs and the per-request block tables behind them."""

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.block_size = block_size
        # A KV block no request holds, where padded decode rows write (engine/cuda_graphs.py).
        self.scratch_block: int | None = None
        super().__init__(device, max(1, max_tokens), max(1, max_seqs), max(1, max_blocks_per_seq))
        # Persistent per-request block tables: request id -> row, and blocks written per row.
        self._req_table = np.zeros((max(1, max_seqs), self.width), dtype=np.int64)
        self._rows: dict[str, int] = {}
        self._row_blocks: list[int] = [0] * self._req_table.shape[0]
        self._row_last: list[int] = [-1] * self._req_table.shape[0]
        self._free_rows: list[int] = list(range(self._req_table.shape[0] - 1, -1, -1))
        # Positions of a chunk, and the rows of a step's decodes, are slices of this (grown on
        # demand, never per token).
        self._arange = np.arange(max(max_seqs, max_blocks_per_seq * block_size), dtype=np.int64)

    # -- buffers ------------------------------------------------------------------------------
    def _allocate(self, max_tokens: int, max_seqs: int, width: int) -> None:
        # Runs from StepBuffers.__init__ too, before the block table and the rows exist: it
        # touches only the buffers and the view cache.
        super()._allocate(max_tokens, max_seqs, width)
        # The last step's views, reused while the step's shape stays (decode after decode):
        # making a view costs more than filling a decode step's inputs.
        self._view_key: tuple[int, ...] = ()
        self._view_val: tuple[torch.Tensor, ...] = ()

    def _ensure(self, tokens: int, seqs: int, width: int) -> bool:
        grew = super()._ensure(tokens, seqs, width)
        # The persistent table is as wide as the buffers' block table (checked only on growth:
        # _ensure runs every step).
        if grew and self.width > self._req_table.shape[1]:
            grown = np.zeros((self._req_table.shape[0], self.width), dtype=np.int64)
            grown[:, : self._req_table.shape[1]] = self._req_table
            self._req_table = grown
        return grew

    # -- per-request block tables -------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Forget a request's row (it finished, or was preempted and will get new blocks)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._row_blocks[row] = 0
            self._row_last[row] = -1
            self._free_rows.append(row)

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def _new_row(self) -> int:
        if not self._free_rows:
            old = self._req_table.shape[0]
            grown = np.zeros((2 * old, self._req_table.shape[1]), dtype=np.int64)
            grown[:old] = self._req_table
            self._req_table = grown
            self._row_blocks.extend([0] * old)
            self._row_last.extend([-1] * old)
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _rows_for(self, order: list[ScheduledRequest]) -> list[int]:
        """Each request's persistent row, brought up to date: O(1) for a request whose blocks
        did not change, O(new blocks) for one that gained some."""
        rows = []
        get, known, last = self._rows.get, self._row_blocks, self._row_last
        for s in order:
            row = get(s.request_id)
            b = s.block_ids
            if row is None or len(b) != known[row] or b[-1] != last[row]:
                row = self._update_row(s, row)
            rows.append(row)
        return rows

    def _update_row(self, s: ScheduledRequest, row: int | None) -> int:
        if row is None:
            row = self._rows[s.request_id] = self._new_row()
        blocks = s.block_ids
        n, known = len(blocks), self._row_blocks[row]
        # A live request's blocks only ever grow at the end; anything else (which the
        # finished/preempted reports should have caught) rewrites the row from scratch.
        if n < known or (known and blocks[known - 1] != self._row_last[row]):
            known = 0
        if n > self._req_table.shape[1]:
            self._ensure(0, 0, n)
        self._req_table[row, known:n] = blocks[known:]
        self._row_blocks[row] = n
        self._row_last[row] = blocks[-1] if blocks else -1
        return row

    # -- one step -----------------------------------------------------------------------------
    def prepare(self, so: SchedulerOutput, pad_to: int | None = None) -> StepBatch:
        """Fill the step's inputs (decodes first, then chunks) and move them to the device. A
        decode-only step may be padded with scratch rows up to `pad_to` rows, for a captured
        graph of that size (the returned views still cover the real rows only)."""
        bs = self.block_size
        decodes: list[ScheduledRequest] = []
        chunks: list[ScheduledRequest] = []
        for s in so.scheduled:
            (decodes if len(s.token_ids) == 1 else chunks).append(s)
        order = decodes + chunks
        nd, num_seqs = len(decodes), len(order)
        dec_pos = [s.start_pos for s in decodes]
        chunk_q = [len(s.token_ids) for s in chunks]
        ctx = [p + 1 for p in dec_pos] + [s.start_pos + n for s, n in zip(chunks, chunk_q)]
        T = nd + sum(chunk_q)
        nb_max = -(-max(ctx) // bs)
        self._ensure(T, num_seqs, nb_max)
        rows = self._rows_for(order)  # may grow the persistent table: before any view of it

        h = self._next_host()
        if len(self._arange) < num_seqs:
            self._arange = np.arange(2 * num_seqs, dtype=np.int64)
        iota = self._arange
        ids, pos = h.ids, h.pos
        tok_rows = h.kv_slots[1]  # scratch: each token's persistent row, overwritten below
        firsts: list[int] = []
        if nd:
            ids[:nd] = [s.token_ids[0] for s in decodes]
            pos[:nd] = dec_pos
            tok_rows[:nd] = rows[:nd]
        r = nd
        for s, n, row in zip(chunks, chunk_q, rows[nd:]):
            if s.start_pos + n > len(iota):
                iota = self._arange = np.arange(2 * (s.start_pos + n), dtype=np.int64)
            ids[r : r + n] = s.token_ids
            pos[r : r + n] = iota[s.start_pos : s.start_pos + n]
            tok_rows[r : r + n] = row
            firsts.append(r)
            r += n
        blocks, offsets = h.blocks[:T], h.offsets[:T]
        k_slots, v_slots = h.kv_slots[0, :T], h.kv_slots[1, :T]
        np.floor_divide(pos[:T], bs, out=offsets)  # scratch: block index within the request
        flat_index = tok_rows[:T] * self._req_table.shape[1] + offsets
        np.take(self._req_table.reshape(-1), flat_index, out=blocks, mode="clip")
        np.remainder(pos[:T], bs, out=offsets)
        # The token's K and V rows in the layer viewed as [num_blocks * 2 * bs, Hkv, D].
        np.multiply(blocks, 2 * bs, out=k_slots)
        k_slots += offsets
        np.add(k_slots, bs, out=v_slots)

        seq_info = h.seq_info[:num_seqs]
        seq_info[:nd, 0] = iota[:nd]
        seq_info[nd:, 0] = firsts
        seq_info[:nd, 1] = 1
        seq_info[nd:, 1] = chunk_q
        seq_info[:, 2] = ctx
        h.ctx[:num_seqs] = ctx
        samplers = [s for s in order if s.sample]
        n_samp = len(samplers)
        if n_samp == num_seqs and not chunks:
            h.logit_rows[:n_samp] = iota[:n_samp]
        elif n_samp:
            ends = list(range(nd)) + [f + n - 1 for f, n in zip(firsts, chunk_q)]
            h.logit_rows[:n_samp] = [e for e, s in zip(ends, order) if s.sample]
        h.table[:num_seqs, :nb_max] = self._req_table[rows, :nb_max]
        used_seqs = num_seqs
        if pad_to is not None and (chunks or n_samp != nd or pad_to < nd):
            pad_to = None  # only a step of decodes, all sampled, is padded (for a graph)
        if pad_to is not None:
            self._pad(h, nd, pad_to)
            used_seqs = pad_to

        self._copy_to_device(self.regions.table.start + used_seqs * self.width)
        nb_dec = -(-max(ctx[:nd]) // bs) if nd else 0
        batch = self._views(order, samplers, nd, T, nb_dec, nb_max, chunk_q)
        return batch if pad_to is None else batch._replace(padded_to=pad_to)

    def _pad(self, h: Regions, start: int, stop: int) -> None:
        """Decode rows [start, stop) of padding: token 0 at position 0, its K/V written to and
        read from the scratch block alone."""
        assert self.scratch_block is not None, "padding needs a scratch block"
        if len(self._arange) < stop:
            self._arange = np.arange(2 * stop, dtype=np.int64)
        p, b, bs = slice(start, stop), self.scratch_block, self.block_size
        h.ids[p] = 0
        h.pos[p] = 0
        h.blocks[p] = b
        h.offsets[p] = 0
        h.kv_slots[0, p] = b * 2 * bs
        h.kv_slots[1, p] = b * 2 * bs + bs
        h.logit_rows[p] = self._arange[p]
        h.seq_info[p, 0] = self._arange[p]
        h.seq_info[p, 1] = 1
        h.seq_info[p, 2] = 1
        h.ctx[p] = 1
        h.table[p, 0] = b

    def padded_decodes(self, size: int) -> StepBatch:
        """`size` decode rows, all padding, in place; the returned views are the ones a graph of
        that size is captured over: the same buffer addresses every later decode step fills.
        Their block table spans the buffer's whole width (a kernel reads a row's first blocks
        only, up to its context length)."""
        self._ensure(size, size, 1)
        for host in self._all_hosts():
            self._pad(host, 0, size)
        self._copy_to_device(self.regions.table.start + size * self.width)
        d = self._dev_regions
        table = d.table[:size]
        md = AttentionMetadata(
            slot_blocks=d.blocks[:size],
            slot_offsets=d.offsets[:size],
            num_decodes=size,
            decode_block_table=table,
            decode_context_lens=d.ctx[:size],
            decode_mask=None,
            prefills=(),
            kv_slots=d.kv_slots[:, :size],
            seq_info=d.seq_info[:size],
            block_table=table,
            context_lens=d.ctx[:size],
        )
        return StepBatch(d.ids[:size], d.pos[:size], d.logit_rows[:size], md, [], [])

    def _views(
        self,
        order: list[ScheduledRequest],
        samplers: list[ScheduledRequest],
        nd: int,
        T: int,
        nb_dec: int,
        nb_max: int,
        chunk_q: list[int],
    ) -> StepBatch:
        S = len(order)
        key = (T, S, nd, len(samplers), nb_dec, nb_max)
        if key != self._view_key:
            d = self._dev_regions
            table = d.table[:S]
            self._view_val = (
                d.ids[:T], d.pos[:T], d.blocks[:T], d.offsets[:T], d.kv_slots[:, :T],
                d.logit_rows[: len(samplers)], d.seq_info[:S], d.ctx[:nd], d.ctx[:S], table,
                table[:nd, :nb_dec], table[:, :nb_max],
            )  # fmt: skip
            self._view_key = key
        ids, pos, blocks, offsets, kv_slots, logit_rows, seq_info, ctx_dec, ctx, table, dec, tab = (
            self._view_val
        )
        segs = []
        row = nd
        for i, (s, n) in enumerate(zip(order[nd:], chunk_q), nd):
            nb = -(-(s.start_pos + n) // self.block_size)
            segs.append(PrefillSegment(row, n, s.start_pos, table[i, :nb]))
            row += n
        md = AttentionMetadata(
            slot_blocks=blocks,
            slot_offsets=offsets,
            num_decodes=nd,
            decode_block_table=dec,
            decode_context_lens=ctx_dec,
            decode_mask=None,
            prefills=tuple(segs),
            kv_slots=kv_slots,
            seq_info=seq_info,
            block_table=tab,
            context_lens=ctx,
        )
        return StepBatch(ids, pos, logit_rows, md, order, samplers)
