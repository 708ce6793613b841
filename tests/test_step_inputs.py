"""The runner's preallocated step inputs against inputs built from Python lists, step by step."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, write_kv
from engine.kv_cache import KVCache, KVCacheSpec
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.step_inputs import StepInputs
from tests.helpers import assert_pool_free, drain, make_engine, random_prompts

BS = 4
SP = SamplingParams(max_tokens=4, temperature=0.0)


def req(rid: str, tokens: list[int], start: int, blocks: list[int], sample: bool = True):
    return ScheduledRequest(rid, tuple(tokens), start, tuple(blocks), sample, SP)


def step(*scheduled: ScheduledRequest, finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled=tuple(scheduled),
        num_batched_tokens=sum(len(s.token_ids) for s in scheduled),
        preempted_request_ids=tuple(preempted),
        finished_request_ids=tuple(finished),
    )


def ctx_of(s: ScheduledRequest) -> int:
    return s.start_pos + len(s.token_ids)


def check(inputs: StepInputs, so: SchedulerOutput) -> None:
    """Every view of the prepared step equals what the scheduled requests say."""
    for rid in (*so.finished_request_ids, *so.preempted_request_ids):
        inputs.release(rid)
    b = inputs.prepare(so)
    order = [s for s in so.scheduled if len(s.token_ids) == 1]
    nd = len(order)
    order += [s for s in so.scheduled if len(s.token_ids) > 1]
    assert b.order == order and b.md.num_decodes == nd
    ids = [t for s in order for t in s.token_ids]
    pos = [p for s in order for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
    blocks = [s.block_ids[p // BS] for s in order for p in range(s.start_pos, ctx_of(s))]
    assert b.input_ids.tolist() == ids
    assert b.positions.tolist() == pos
    md = b.md
    assert md.slot_blocks.tolist() == blocks
    assert md.slot_offsets.tolist() == [p % BS for p in pos]
    assert md.kv_slots is not None
    k_rows = [blk * 2 * BS + p % BS for blk, p in zip(blocks, pos)]
    assert md.kv_slots.tolist() == [k_rows, [r + BS for r in k_rows]]
    ctx = [s.start_pos + len(s.token_ids) for s in order]
    assert md.decode_context_lens.dtype == torch.int32
    assert md.decode_context_lens.tolist() == ctx[:nd]
    assert md.context_lens is not None and md.context_lens.tolist() == ctx
    assert md.seq_info is not None and md.block_table is not None
    q = [len(s.token_ids) for s in order]
    firsts = [sum(q[:i]) for i in range(len(q))]
    assert md.seq_info.tolist() == [[f, n, c] for f, n, c in zip(firsts, q, ctx)]
    for i, s in enumerate(order):
        nb = -(-ctx[i] // BS)
        assert md.block_table[i, :nb].tolist() == list(s.block_ids[:nb])
        if i < nd:
            assert md.decode_block_table[i, :nb].tolist() == list(s.block_ids[:nb])
    for seg, s, f in zip(md.prefills, order[nd:], firsts[nd:]):
        assert (seg.row_start, seg.num_tokens, seg.start_pos) == (f, len(s.token_ids), s.start_pos)
        assert seg.block_table.tolist() == list(s.block_ids[: -(-ctx[order.index(s)] // BS)])
    rows = [f + n - 1 for f, n, s in zip(firsts, q, order) if s.sample]
    assert b.logit_rows.tolist() == rows
    assert [s.request_id for s in b.samplers] == [s.request_id for s in order if s.sample]


def test_steps_grow_release_and_reuse_rows():
    inputs = StepInputs(torch.device("cpu"), BS, max_tokens=8, max_seqs=2, max_blocks_per_seq=3)
    # A prompt in two chunks next to nothing, then beside a decode of another request.
    check(inputs, step(req("a", list(range(6)), 0, [7, 3], sample=False)))
    check(inputs, step(req("b", [9], 4, [1, 2]), req("a", [6, 7, 8], 6, [7, 3, 5])))
    # More tokens, sequences and blocks than the buffers were made for: they grow.
    check(
        inputs,
        step(
            req("a", [1], 9, [7, 3, 5]),
            req("b", [2], 5, [1, 2]),
            req("c", list(range(20)), 0, [11, 12, 13, 14, 15]),
        ),
    )
    assert inputs.num_rows_in_use == 3
    # b finished, a preempted: their rows go; a returns later on other blocks, same id.
    check(
        inputs, step(req("c", [3], 20, [11, 12, 13, 14, 15, 16]), finished=["b"], preempted=["a"])
    )
    assert inputs.num_rows_in_use == 1
    check(inputs, step(req("c", [4], 21, [11, 12, 13, 14, 15, 16]), req("a", [1, 2, 3], 0, [4])))
    assert inputs.num_rows_in_use == 2


def test_unreported_block_change_rewrites_the_row():
    inputs = StepInputs(torch.device("cpu"), BS, max_tokens=16, max_seqs=4, max_blocks_per_seq=8)
    check(inputs, step(req("a", [1], 8, [1, 2, 3])))
    check(inputs, step(req("a", [1], 8, [4, 5, 6])))  # not a growth: must not keep 1, 2, 3
    check(inputs, step(req("a", [1], 2, [9])))  # fewer blocks


def test_decode_steps_keep_their_addresses():
    """A decode-only step's inputs start at the same addresses every step (what a captured
    graph replays from)."""
    inputs = StepInputs(torch.device("cpu"), BS, max_tokens=16, max_seqs=4, max_blocks_per_seq=8)
    ptrs = set()
    for i in range(3):
        b = inputs.prepare(step(req("a", [1], 5 + i, [1, 2, 3]), req("b", [2], 9 + i, [4, 5, 6])))
        md = b.md
        assert md.seq_info is not None and md.block_table is not None
        ptrs.add(
            (
                b.input_ids.data_ptr(),
                b.positions.data_ptr(),
                md.decode_block_table.data_ptr(),
                md.decode_context_lens.data_ptr(),
                md.seq_info.data_ptr(),
                b.logit_rows.data_ptr(),
            )
        )
    assert len(ptrs) == 1


def test_flat_kv_write_equals_the_cache_write():
    g = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(1, 2, 8, BS, torch.float32)
    a, b = KVCache(spec, 6, torch.device("cpu")), KVCache(spec, 6, torch.device("cpu"))
    blocks = torch.tensor([5, 5, 0, 3, 1])
    offsets = torch.tensor([0, 3, 2, 1, 3])
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    md = AttentionMetadata(blocks, offsets, 0, torch.empty(0, 0, dtype=torch.long),
                           torch.empty(0, dtype=torch.int32), None, ())  # fmt: skip
    write_kv(a, 0, k, v, md)
    flat_md = AttentionMetadata(
        blocks, offsets, 0, md.decode_block_table, md.decode_context_lens, None, (),
        kv_slots=torch.stack([blocks * 2 * BS + offsets, blocks * 2 * BS + BS + offsets]),
    )  # fmt: skip
    write_kv(b, 0, k, v, flat_md)
    assert torch.equal(a.layers[0], b.layers[0]) and a.layers[0].abs().sum() > 0


def test_engine_releases_every_row():
    """Rows follow requests through finishing and preemption: none is left once all ended."""
    engine = make_engine("tiny-llama", num_blocks=14, budget=32, max_num_seqs=4)
    prompts = random_prompts([9, 13, 6, 11, 3], seed=3)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    drain(engine)
    assert engine.scheduler.num_preemptions > 0
    engine.step()  # reports the last finished requests to the runner
    assert engine.runner.inputs.num_rows_in_use == 0
    assert_pool_free(engine)


def test_more_sequences_than_positions():
    """Short sequences, many of them: the step outgrows every buffer at once."""
    inputs = StepInputs(torch.device("cpu"), BS, max_tokens=2, max_seqs=1, max_blocks_per_seq=1)
    check(inputs, step(*(req(f"r{i}", [i], 0, [i]) for i in range(9))))
    check(inputs, step(*(req(f"r{i}", [i], 1, [i]) for i in range(9)), req("c", [5, 6], 0, [20])))
