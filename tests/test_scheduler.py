"""Scheduler tests driven by fake runner outputs: no model, no tensors."""

import pytest

from engine import kv_handoff
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ChunkSizer, Scheduler

EOS = 999


def make(budget=16, seqs=8, blocks=64, bs=4, chunked=True, caching=True):
    kv = KVCacheManager(blocks, bs, caching)
    return Scheduler(SchedulerConfig(budget, min(seqs, budget), chunked), kv)


def req(rid, n, max_tokens=4, start=0):
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(start, start + n)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_time=0.0,
        eos_token_ids=frozenset({EOS}),
    )


def fake_run(out: SchedulerOutput, token=7) -> ModelRunnerOutput:
    ids = tuple(s.request_id for s in out.scheduled if s.sample)
    return ModelRunnerOutput(ids, tuple(token for _ in ids))


def step(s: Scheduler, token=7):
    out = s.schedule()
    s.update_from_output(out, fake_run(out, token))
    return out


def test_chunked_prefill_then_decode_and_finish():
    s = make(budget=8)
    s.add_request(req("a", 20, max_tokens=3))
    chunks = [len(step(s).scheduled[0].token_ids) for _ in range(3)]
    assert chunks == [8, 8, 4]  # the third chunk ends the prompt and samples
    r = s.requests["a"]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 20
    step(s)
    step(s)
    assert "a" not in s.requests and r.status is RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [7, 7, 7]
    assert s.kv.pool.all_free()


def test_decodes_scheduled_before_prefill_chunks():
    s = make(budget=6)
    s.add_request(req("d", 3, max_tokens=10))
    step(s)  # d prefilled, now decoding
    s.add_request(req("p", 40, start=100))
    out = step(s)
    ids = [x.request_id for x in out.scheduled]
    assert ids == ["d", "p"]
    assert [len(x.token_ids) for x in out.scheduled] == [1, 5]
    assert out.num_batched_tokens == 6
    s.finish_requests(["d", "p"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_budget_splits_prompt_mid_block():
    s = make(budget=6, bs=4)
    s.add_request(req("a", 10))
    out = step(s)
    assert out.scheduled[0].token_ids == tuple(range(6))
    assert len(out.scheduled[0].block_ids) == 2  # 6 tokens need 2 blocks of 4
    out = step(s)
    assert out.scheduled[0].start_pos == 6 and out.scheduled[0].sample
    s.finish_requests(["a"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_max_num_seqs_limits_running():
    s = make(budget=100, seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=5, start=10 * i))
    out = step(s)
    assert len(out.scheduled) == 2 and len(s.running) == 2
    s.finish_requests([f"r{i}" for i in range(4)], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_preemption_newest_first_and_recompute():
    s = make(budget=64, blocks=6, bs=4, caching=False)
    s.add_request(req("old", 8, max_tokens=12))
    s.add_request(req("new", 8, max_tokens=12, start=50))
    new = s.requests["new"]
    preempted: list[str] = []
    resumed = None
    for _ in range(60):
        if not s.num_unfinished:
            break
        was_preempted = new.status is RequestStatus.PREEMPTED
        known = list(new.token_ids)
        out = step(s)
        s.kv.pool.check_invariants()
        preempted += out.preempted_request_ids
        mine = [x for x in out.scheduled if x.request_id == "new"]
        if was_preempted and mine and resumed is None:
            resumed = mine[0]
            # Recompute: from position 0, over the prompt and the outputs it had produced.
            assert resumed.start_pos == 0
            assert list(resumed.token_ids) == known[: len(resumed.token_ids)]
            assert len(known) > 8
    assert preempted and preempted[0] == "new"
    assert resumed is not None and new.num_preemptions >= 1
    assert s.num_unfinished == 0 and new.num_output_tokens == 12
    assert s.kv.pool.all_free()


def test_a_preempted_request_s_cached_tokens_stay_those_of_its_first_admission():
    """Recomputed after a preemption, it finds its own blocks (prompt and output) in the prefix
    cache: its prompt's hit at first admission stays what it reports (never more than its
    prompt), and the cache's lookups count its first admission only."""
    s = make(budget=64, blocks=7, bs=4, caching=True)
    s.add_request(req("old", 8, max_tokens=12))
    s.add_request(req("new", 8, max_tokens=12, start=50))
    new = s.requests["new"]
    for _ in range(80):
        if not s.num_unfinished:
            break
        step(s)
        s.kv.pool.check_invariants()
    assert new.num_preemptions >= 1 and new.num_output_tokens == 12
    assert new.num_cached_tokens == 0  # a prompt nothing held
    assert s.kv.pool.stats.queries == 16  # the two prompts, once each
    s.add_request(req("again", 8, max_tokens=1, start=50))
    again = s.requests["again"]
    step(s)
    assert again.num_cached_tokens == 4  # the first block of new's prompt (at most len - 1)
    while s.num_unfinished:
        step(s)
    assert s.kv.pool.all_free()


def test_request_larger_than_pool_ends_with_length_not_hang():
    s = make(budget=64, blocks=3, bs=4, caching=False)
    s.add_request(req("big", 8, max_tokens=20))
    for _ in range(30):
        step(s)
        if not s.num_unfinished:
            break
    (r,) = s.take_capacity_finished()
    assert r.finish_reason is FinishReason.LENGTH and r.stop_reason == "kv_cache_capacity"
    assert r.num_tokens == 13  # 12 tokens of KV in 3 blocks, and the token they produced
    assert s.kv.pool.all_free()


def test_prefix_hit_skips_cached_blocks_and_caps_at_len_minus_one():
    s = make(budget=64, bs=4)
    s.add_request(req("a", 8, max_tokens=1))
    step(s)  # a finishes; its two full blocks stay cached
    s.add_request(req("b", 8, max_tokens=1))  # identical prompt
    out = step(s)
    b = out.scheduled[0]
    assert b.start_pos == 4 and len(b.token_ids) == 4  # capped: last block recomputed
    s.add_request(req("c", 12, max_tokens=1))  # same first 8 tokens, then more
    out = step(s)
    assert out.scheduled[0].start_pos == 8
    assert s.kv.pool.all_free()
    assert s.kv.pool.stats.hits == 12


def test_eos_and_stop_token_ids_finish():
    s = make()
    a = req("a", 3, max_tokens=10)
    s.add_request(a)
    step(s, token=EOS)
    assert "a" not in s.requests
    assert a.finish_reason is FinishReason.STOP and a.stop_reason is None  # the model's end
    r = req("b", 3, max_tokens=10)
    r.sampling = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(7,))
    s.add_request(r)
    step(s, token=7)
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == 7
    r = req("c", 3, max_tokens=3)
    r.sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    s.add_request(r)
    for _ in range(3):
        step(s, token=EOS)
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3
    assert s.kv.pool.all_free()


def test_unchunked_prefill_runs_whole_prompt_and_stalls_the_decodes():
    s = make(budget=8, chunked=False)
    s.add_request(req("d", 3, max_tokens=10))
    step(s)
    s.add_request(req("long", 20, start=100))
    s.add_request(req("next", 12, start=200))
    out = step(s)
    # The long prompt runs whole, past the budget, in the same step as the decode (which waits
    # for all 20 tokens: the interference chunking avoids); a second long prompt waits.
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("d", 1), ("long", 20)]
    out = step(s)
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [
        ("d", 1),
        ("long", 1),
        ("next", 12),
    ]
    s.finish_requests(["d", "long", "next"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_abort_waiting_and_running():
    s = make(budget=4)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, start=20))
    step(s)
    s.finish_requests(["a", "b", "nope"], FinishReason.ABORT)
    assert s.num_unfinished == 0 and s.kv.pool.all_free()
    out = s.schedule()
    assert set(out.finished_request_ids) == {"a", "b"}


def test_step_target_sizes_prefill_chunks_next_to_decodes():
    # A fake device: a step costs 50 ms + 1 ms per prefill token; the target is 150 ms, so the
    # chunk that fits next to the decode is 100 tokens.
    kv = KVCacheManager(512, 4, True)
    s = Scheduler(SchedulerConfig(512, 8, True, step_target_s=0.150), kv)
    s.add_request(req("p0", 600, max_tokens=2, start=5000))
    first = step(s)
    assert first.num_batched_tokens == 512  # nothing decoding: the whole budget
    s.add_request(req("d", 3, max_tokens=200))
    while s.requests["d"].num_computed_tokens < 3 or "p0" in s.requests:
        step(s)
    s.add_request(req("p", 2000, start=100))
    chunks = []
    for _ in range(10):
        out = step(s)
        n = sum(len(x.token_ids) for x in out.scheduled if x.request_id == "p")
        assert any(x.request_id == "d" for x in out.scheduled)  # the decode runs every step
        chunks.append(n)
        s.observe_step(n, 1, 0.050 + 0.001 * n)
    assert chunks[0] == 64  # a small first guess, learned up from there
    assert all(abs(c - 100) <= 1 for c in chunks[-4:]), chunks
    s.observe_step(100, 1, 0.600)  # a slow step (the machine got busy): the next chunk shrinks
    assert s.sizer is not None and s.sizer.chunk == 25
    s.finish_requests(["d", "p"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_step_target_is_ignored_without_chunking():
    s = Scheduler(SchedulerConfig(16, 8, False, step_target_s=0.1), KVCacheManager(64, 4, True))
    assert s.sizer is None


def test_the_step_target_can_change_while_serving():
    """The router tunes a worker's target from the gaps its requests see: set, retargeted
    (keeping the chunk learned), dropped; refused without chunking or when not positive."""
    s = Scheduler(SchedulerConfig(512, 8, True), KVCacheManager(64, 4, True))
    assert s.sizer is None
    s.set_step_target(0.1)
    assert s.sizer is not None and s.sizer.target_s == 0.1
    s.sizer.chunk = 200
    s.set_step_target(0.05)
    assert s.sizer.target_s == 0.05 and s.sizer.chunk == 200
    s.observe_step(200, 1, 0.1)  # twice the new target: the chunk halves
    assert s.sizer.chunk == 100
    s.set_step_target(None)
    assert s.sizer is None
    with pytest.raises(ValueError, match="step_target_s"):
        s.set_step_target(0.0)
    plain = Scheduler(SchedulerConfig(16, 8, False), KVCacheManager(64, 4, True))
    with pytest.raises(ValueError, match="chunked prefill"):
        plain.set_step_target(0.1)


def test_chunk_sizer_grows_at_most_twice_and_learns_only_from_full_chunks():
    sizer = ChunkSizer(target_s=0.1, budget=512)
    assert sizer.chunk == 64
    sizer.observe(64, 1, 0.001)  # a very fast step: would allow 6,400 tokens
    assert sizer.chunk == 128  # 2x at most
    sizer.observe(128, 0, 10.0)  # no decodes in that step: says nothing about them
    sizer.observe(20, 1, 10.0)  # a prompt's short tail: the fixed costs, not a chunk's
    assert sizer.chunk == 128
    sizer.observe(128, 1, 1.0)  # a full chunk ten times over the target: shrinks at once
    assert sizer.chunk == 16  # 12.8 tokens would fit: MIN_CHUNK, so the prompt still advances
    for _ in range(10):
        sizer.observe(sizer.chunk, 1, 0.0001)
    assert sizer.chunk == 512  # never past the token budget


def test_step_target_holds_while_a_handoffs_kv_is_on_its_way():
    kv = KVCacheManager(512, 4, True)
    s = Scheduler(SchedulerConfig(512, 8, True, step_target_s=0.1), kv)
    s.add_request(req("p", 900, start=1000))
    assert step(s).num_batched_tokens == 512  # nothing decoding, nothing expected: all of it
    assert kv_handoff.reserve(s, req("h", 40)) is not None
    assert step(s).num_batched_tokens == 64  # a handoff may land any moment: a sized chunk
    kv_handoff.fail(s, "h")
    s.finish_requests(["h", "p"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_a_handoff_whose_kv_is_not_due_yet_leaves_the_chunks_whole(monkeypatch):
    """A reservation made while its prompt still waits on its prefill worker (the router's
    Placement.kv_due_in_s) shrinks no chunk here until its KV may land; from then on it does."""
    clock = [100.0]
    # kv_due's clock, and kv_handoff's too
    monkeypatch.setattr("engine.request_queues.time.monotonic", lambda: clock[0])
    kv = KVCacheManager(512, 4, True)
    s = Scheduler(SchedulerConfig(512, 8, True, step_target_s=0.1), kv)
    s.add_request(req("p", 1500, start=1000))
    assert kv_handoff.reserve(s, req("h", 40), due_in_s=5.0) is not None
    assert not list(s.kv_due())
    assert step(s).num_batched_tokens == 512  # its KV comes in 5 s at the soonest: all of it
    clock[0] += 4.9
    assert step(s).num_batched_tokens == 512
    clock[0] += 0.1
    assert [r.request_id for r in s.kv_due()] == ["h"]
    assert step(s).num_batched_tokens == 64  # it may land now: a sized chunk
    kv_handoff.fail(s, "h")
    s.finish_requests(["h", "p"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def _held_scheduler(hold_s):
    """A scheduler whose sizer has seen a 16-token chunk beside a decode take 130 ms (past its
    100 ms target) and decode-only steps take 40 ms."""
    s = Scheduler(
        SchedulerConfig(512, 8, True, step_target_s=0.1, prefill_hold_s=hold_s),
        KVCacheManager(512, 4, True),
    )
    assert s.sizer is not None
    for _ in range(3):
        s.sizer.observe(16, 1, 0.130)
        s.sizer.observe(0, 1, 0.040)
    assert not s.sizer.fits() and s.sizer.floor_s == 0.130
    return s


def _decoding(s, rid, max_tokens):
    s.add_request(req(rid, 3, max_tokens=max_tokens, start=7000))
    while s.requests[rid].num_computed_tokens < 3:
        step(s)


def test_a_prompt_waits_for_decodes_that_end_within_its_hold():
    """Where the smallest chunk beside decodes takes a step past the target, a prompt waits for
    decodes that will end within its hold: their steps run alone, then the prompt gets the whole
    budget (no chunk beside a decode at all)."""
    s = _held_scheduler(hold_s=1.0)
    _decoding(s, "d", max_tokens=10)  # 9 tokens left at 40 ms: 0.36 s, within the hold
    s.add_request(req("p", 900, max_tokens=2, start=100))
    beside = []
    while "d" in s.requests:
        out = step(s)
        ids = {x.request_id for x in out.scheduled}
        beside.append("p" in ids)
        assert ids == {"d"} or "d" not in ids
    assert not any(beside) and s.num_held_steps == len(beside)
    assert s.requests["p"].num_computed_tokens == 0
    assert step(s).num_batched_tokens == 512  # the decodes ended: the whole budget
    s.finish_requests(["p"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_a_prompt_does_not_wait_for_decodes_that_outlast_its_hold():
    s = _held_scheduler(hold_s=1.0)
    _decoding(s, "d", max_tokens=100)  # 99 tokens left at 40 ms: 4 s, past the hold
    s.add_request(req("p", 900, max_tokens=2, start=100))
    out = step(s)
    assert {x.request_id for x in out.scheduled} == {"d", "p"} and s.num_held_steps == 0
    s.finish_requests(["d", "p"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_the_time_a_prompt_waited_counts_against_its_hold(monkeypatch):
    """Each prompt waits at most its hold in all: the time between held steps counts against
    every prompt in line, and once the longest-waiting one could not see the decodes end
    within what it has left, its chunks run beside them."""
    clock = [0.0]
    monkeypatch.setattr("engine.scheduler.time.monotonic", lambda: clock[0])
    s = _held_scheduler(hold_s=1.0)
    _decoding(s, "d", max_tokens=20)  # 19 left at 40 ms: 0.76 s
    s.add_request(req("p", 900, max_tokens=2, start=100))
    held = 0
    for _ in range(19):
        out = step(s)
        clock[0] += 0.1  # each step takes 100 ms: the decodes take longer than predicted
        if "p" in {x.request_id for x in out.scheduled}:
            break
        held += 1
        # What the worker reports (WorkerLoad): the hold less the time waited so far, the held
        # step running included.
        assert s.hold_left_s is not None and abs(s.hold_left_s - (1.0 - 0.1 * held)) < 1e-9
    # Step k holds while waited + 40 ms x tokens left <= 1 s: 0.1 k + 0.04 (19 - k) <= 1, k <= 4.
    assert held == 5 and abs(s.requests["p"].held_s - 0.5) < 1e-9
    # Prefilling in chunks: still in line.
    assert s.hold_left_s is not None and abs(s.hold_left_s - 0.5) < 1e-9
    for _ in range(200):
        if s.requests["p"].num_output_tokens:
            break
        step(s)
    assert s.requests["p"].held_s >= 0.5 and s.hold_left_s is None  # decoding: not in line
    s.finish_requests(["d", "p"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_no_wait_where_the_smallest_chunk_fits_the_target_or_none_is_set():
    s = _held_scheduler(hold_s=1.0)
    s.set_step_target(0.2)  # a 130 ms step beside the decodes keeps to it
    assert s.sizer is not None and s.sizer.fits()
    _decoding(s, "d", max_tokens=10)
    s.add_request(req("p", 900, max_tokens=2, start=100))
    assert "p" in {x.request_id for x in step(s).scheduled}
    off = _held_scheduler(hold_s=None)
    _decoding(off, "d", max_tokens=10)
    off.add_request(req("p", 900, max_tokens=2, start=100))
    assert "p" in {x.request_id for x in step(off).scheduled} and off.num_held_steps == 0
    with pytest.raises(ValueError, match="prefill_hold_s"):
        SchedulerConfig(512, 8, True, step_target_s=0.1, prefill_hold_s=-1.0)


def test_a_requests_own_hold_stands_in_for_the_schedulers():
    """A request may bring its own hold (the router's, from its TTFT SLO): a prompt whose own
    hold outlasts the decodes waits where the scheduler's own would not, one whose hold is 0
    never waits, and with either in line, every prompt there waits no longer than the least
    hold left among them (what the worker reports to the router)."""
    s = _held_scheduler(hold_s=None)  # no hold of its own
    _decoding(s, "d", max_tokens=10)  # 9 tokens left at 40 ms: 0.36 s
    p = req("p", 900, max_tokens=2, start=100)
    p.prefill_hold_s = 1.0
    s.add_request(p)
    assert {x.request_id for x in step(s).scheduled} == {"d"} and s.num_held_steps == 1
    assert s.hold_left_s is not None and 0.9 < s.hold_left_s <= 1.0
    never = req("never", 20, max_tokens=2, start=2000)
    never.prefill_hold_s = 0.0
    s.add_request(never)
    assert s.hold_left_s == 0.0
    assert "p" in {x.request_id for x in step(s).scheduled} and s.num_held_steps == 1
    s.finish_requests(["d", "p", "never"], FinishReason.ABORT)
    assert s.hold_left_s is None and s.kv.pool.all_free()

    s = _held_scheduler(hold_s=1.0)
    _decoding(s, "d", max_tokens=10)
    s.add_request(req("p", 900, max_tokens=2, start=100))  # the scheduler's 1 s
    short = req("short", 20, max_tokens=2, start=2000)
    short.prefill_hold_s = 0.2  # 0.36 s of decodes outlast it
    s.add_request(short)
    assert s.hold_left_s == pytest.approx(0.2)
    assert "p" in {x.request_id for x in step(s).scheduled} and s.num_held_steps == 0
    s.finish_requests(["d", "p", "short"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_a_prompt_that_streamed_already_leaves_no_hold_to_the_line():
    """A request back in line that streamed tokens never waits, so the worker reports no hold
    left while it is there: the router prices no wait for a prompt placed behind it."""
    s = _held_scheduler(hold_s=1.0)
    _decoding(s, "d", max_tokens=10)
    s.add_request(req("p", 900, max_tokens=2, start=100))
    assert s.hold_left_s == 1.0
    back = req("back", 40, max_tokens=10, start=300)
    back.append_output(5)
    s.add_request(back)
    assert s.hold_left_s == 0.0
    s.finish_requests(["d", "p", "back"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_the_slowest_of_the_latest_smallest_chunk_steps_decides_whether_a_chunk_fits():
    """An ITL SLO holds a p99 gap: one smallest-chunk step in eight past the target means chunks
    beside decodes do not keep to it; it stops counting once eight newer ones came."""
    sizer = ChunkSizer(target_s=0.1, budget=512)
    sizer.observe(16, 1, 0.130)
    for _ in range(7):
        sizer.observe(16, 1, 0.090)
    assert sizer.floor_s == 0.130 and not sizer.fits()
    sizer.observe(12, 2, 0.090)  # a prompt's tail of the smallest chunk counts too
    assert sizer.floor_s == 0.090 and sizer.fits()
    sizer.observe(4, 1, 0.5)  # a few tokens: a prompt's last, not a chunk's step
    assert sizer.fits()


def test_no_wait_for_a_request_that_streamed_already_nor_past_a_handoff_to_come():
    """A preempted decode (or a handoff whose KV never came) back in line has streamed tokens:
    a wait would be a gap in its stream. A handoff whose KV is on its way decodes soon: a long
    one ends the wait as a running one does."""
    s = _held_scheduler(hold_s=1.0)
    _decoding(s, "d", max_tokens=10)
    back = req("back", 40, max_tokens=10, start=300)
    back.append_output(5)  # it streamed a token before it was preempted
    s.add_request(back)
    assert "back" in {x.request_id for x in step(s).scheduled} and s.num_held_steps == 0
    s.finish_requests(["back"], FinishReason.ABORT)
    s.add_request(req("p", 900, max_tokens=2, start=100))
    assert {x.request_id for x in step(s).scheduled} == {"d"} and s.num_held_steps == 1
    assert kv_handoff.reserve(s, req("h", 40, max_tokens=200, start=2000)) is not None
    assert "p" in {x.request_id for x in step(s).scheduled}  # 200 tokens to come: no wait
    kv_handoff.fail(s, "h")
    s.finish_requests(["d", "p", "h"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def test_a_prompt_does_not_wait_for_a_handoff_whose_kv_is_not_due_yet():
    """The hold waits for the decodes running and the handoffs that may land now; one whose KV
    is due later is not about to decode, and its length does not end the wait."""
    s = _held_scheduler(hold_s=1.0)
    _decoding(s, "d", max_tokens=10)  # 0.36 s left: within the hold
    assert (
        kv_handoff.reserve(s, req("h", 40, max_tokens=200, start=2000), due_in_s=30.0) is not None
    )
    s.add_request(req("p", 900, max_tokens=2, start=100))
    assert {x.request_id for x in step(s).scheduled} == {"d"} and s.num_held_steps == 1
    kv_handoff.fail(s, "h")
    s.finish_requests(["d", "p", "h"], FinishReason.ABORT)
    assert s.kv.pool.all_free()


def teach(s: Scheduler, fixed_s: float, per_token_s: float, sizes=(8, 16, 32, 64) * 2) -> None:
    for n in sizes:
        s.observe_step(n, 0, fixed_s + per_token_s * n)


def test_prompt_steps_fit_their_cost_and_cap_the_fill_by_the_prompts_behind():
    s = make()
    ps = s.prompt_steps
    for n in (8, 16, 32):  # too few steps to fit
        s.observe_step(n, 0, 0.02 + 0.003 * n)
    assert ps.fill_cap(1) is None
    s.observe_step(40, 2, 5.0)  # steps with decodes say nothing of prompts alone
    teach(s, 0.02, 0.003)
    assert ps.fixed_s == pytest.approx(0.02) and ps.per_token_s == pytest.approx(0.003)
    # 20 ms of fixed cost is 6.7 tokens' worth, for each prompt behind the one that completes.
    assert (ps.fill_cap(1), ps.fill_cap(3)) == (6, 20)
    ps.reset()
    assert ps.fill_cap(1) is None
    # Where tokens cost nothing but jitter (a tiny model), or too little spread: no cap.
    jitter = make()
    for i, n in enumerate((8, 16, 32, 64) * 2):
        jitter.observe_step(n, 0, 0.002 + (0.0005 if i % 3 == 0 else 0.0))
    assert jitter.prompt_steps.fill_cap(1) is None
    flat = make()
    teach(flat, 0.02, 0.003, sizes=(40, 48, 56, 64) * 2)
    assert flat.prompt_steps.fill_cap(1) is None


def test_a_step_of_prompts_that_completes_one_takes_at_most_the_cap_of_the_next():
    """On a compute-bound host the first prompt's last chunk runs with few tokens of the prompts
    behind it (its first token does not wait for their chunks); beside decodes, and before the
    cost is known, the budget fills as always."""
    s = make(budget=64)
    teach(s, 0.02, 0.003)  # 6.7 tokens a prompt behind
    s.add_request(req("a", 20, max_tokens=2))
    s.add_request(req("b", 30, max_tokens=2, start=100))
    s.add_request(req("c", 12, max_tokens=2, start=200))
    out = step(s)  # two prompts behind a: 13 tokens of them
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("a", 20), ("b", 13)]
    out = step(s)  # a decodes beside them: no cap
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [
        ("a", 1),
        ("b", 17),
        ("c", 12),
    ]
    unknown = make(budget=64)
    for r in (req("a", 20, max_tokens=2), req("b", 30, 2, 100), req("c", 12, 2, 200)):
        unknown.add_request(r)
    out = step(unknown)
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [
        ("a", 20),
        ("b", 30),
        ("c", 12),
    ]
    for sched in (s, unknown):
        sched.finish_requests(list(sched.requests), FinishReason.ABORT)
        assert sched.kv.pool.all_free()
