"""Prompts held for short decodes, and prompts queued behind a colocated one, as the policy
prices them, with injected measurements: no workers, no clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.cost_model import prefill_pairs
from router.interference import coming_chunk_step
from router.pool_state import WorkerState
from router.vocab import RoutePath
from tests.cost_fixtures import planner, shape, trained, with_decodes
from worker_protocol.messages import WorkerLoad


def _holding(left: int, floor_s: float = 0.15) -> WorkerState:
    """A decode worker with a 120 ms step target that holds prompts up to 5 s for its decodes
    (prefill_hold_s), its smallest chunks beside decodes polled at `floor_s` a step, and 40
    requests decoding at 1000 tokens each with `left` tokens still to come."""
    d = trained("decode-0", "decode", seed=1, step_target_s=0.12, prefill_hold_s=5.0)
    d.absorb(WorkerLoad("decode-0", d.info.role, 40, 0, 0, 0.1, 1000, 1024, 0,
                        chunk_floor_s=floor_s))  # fmt: skip
    return with_decodes(d, 40, 1000, itl_slo_s=0.12, left=left)


def test_a_worker_that_holds_prompts_for_short_decodes_prices_a_wait_not_their_misses():
    """Where the smallest chunk beside its decodes takes a step past the target and they end
    within the hold, a prompt placed there waits for them and runs alone: its TTFT carries the
    wait, and the decodes keep their own steps (no misses caused). Where they outlast the hold,
    or a chunk keeps to the target, the prompt is priced in chunks beside them, as before."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    req = shape(1500, seed=5)
    held = _holding(left=20)
    wait = held.model.hold_wait_s(held.batch, held.context)
    step = held.model.decode_step_s(40, 40 * 1000)
    assert wait == pytest.approx(20 * step) and wait < 5.0
    colo = {b.path: b for b in pl.decide(req, [p], [held]).best}[RoutePath.COLOCATED]
    alone = held.model.chunked_s(1500, prefill_pairs(1500, 0), 0, 0)[0]
    assert colo.caused_misses < 0.01 and colo.running_itl_s == pytest.approx(step)
    assert colo.raw_ttft_s == pytest.approx(wait + alone)
    for d in (_holding(left=100), _holding(left=20, floor_s=0.11)):  # 10 s of decodes; fits
        assert d.model.hold_wait_s(d.batch, d.context) is None
        colo = {b.path: b for b in pl.decide(req, [p], [d]).best}[RoutePath.COLOCATED]
        assert colo.running_itl_s > 0.13 and colo.caused_misses > 30
    # Each token that comes shortens the wait; a decode of unknown length prices none.
    held.grow("running-0", 10)
    assert held.model.decode_left == 20
    for i in range(1, 40):
        held.grow(f"running-{i}", 10)
    assert held.model.decode_left == 10
    held.add_decode("unknown", 100, 0.12, local=False)
    assert held.model.hold_wait_s(held.batch, held.context) is None
    held.finish("unknown")
    assert held.model.hold_wait_s(held.batch, held.context) is not None


def test_the_hold_a_waiting_prompt_used_is_not_priced_again():
    """A prompt in line there that has waited most of its hold (polled) leaves the rest to a
    prompt placed now: decodes that end within the whole hold but not within what is left are
    priced with chunks beside them, at the smallest chunks' step measured there."""
    d = _holding(left=20)  # 20 decode steps: well within 5 s
    wait = d.model.hold_wait_s(d.batch, d.context)
    assert wait is not None and wait < 4.0
    d.absorb(WorkerLoad("decode-0", d.info.role, 40, 1, 0, 0.1, 1000, 1024, 900,
                        chunk_floor_s=0.15, hold_left_s=wait / 2))  # fmt: skip
    assert d.model.hold_wait_s(d.batch, d.context) is None
    _, during = d.model.chunked_s(1500, prefill_pairs(1500, 0), d.batch, d.context)
    assert during >= 0.15


def test_a_prompts_own_hold_bounds_the_wait_priced_for_it():
    """A request that brings its own hold (RequestShape.prefill_hold_s, from its TTFT SLO) is
    priced by it rather than by the worker's: decodes that outlast it are priced with its chunks
    beside them, ones within it as a wait even past the worker's own hold; 0 prices no wait."""
    d = _holding(left=20)  # the worker's own hold: 5 s
    wait = d.model.hold_wait_s(d.batch, d.context)
    assert wait is not None
    assert d.model.hold_wait_s(d.batch, d.context, wait / 2) is None
    assert d.model.hold_wait_s(d.batch, d.context, 0.0) is None
    assert d.model.hold_wait_s(d.batch, d.context, wait * 1.01) == pytest.approx(wait)
    long = _holding(left=100)  # 100 decode steps: past the worker's 5 s
    assert long.model.hold_wait_s(long.batch, long.context) is None
    assert long.model.hold_wait_s(long.batch, long.context, 60.0) == pytest.approx(5 * wait)
    # The prompts in line there bound it too (polled: the least hold left among them); with no
    # prompt placed now, their holds are what counts, not the worker's own.
    line = _holding(left=100)
    line.absorb(WorkerLoad("decode-0", line.info.role, 40, 1, 0, 0.1, 1000, 1024, 900,
                           chunk_floor_s=0.15, hold_left_s=60.0))  # fmt: skip
    assert line.model.hold_wait_s(line.batch, line.context) == pytest.approx(5 * wait)
    line.absorb(WorkerLoad("decode-0", line.info.role, 40, 1, 0, 0.1, 1000, 1024, 900,
                           chunk_floor_s=0.15, hold_left_s=wait))  # fmt: skip
    assert line.model.hold_wait_s(line.batch, line.context, 60.0) is None
    pl, p = planner(), trained("prefill-0", "prefill")
    for hold, waits in ((None, True), (wait / 2, False), (0.0, False)):
        req = replace(shape(1500, seed=5), prefill_hold_s=hold)
        colo = {b.path: b for b in pl.decide(req, [p], [d]).best}[RoutePath.COLOCATED]
        assert (colo.caused_misses < 0.01) is waits and (colo.caused_misses > 30) is not waits


def test_a_long_handoff_to_a_worker_holding_prompts_ends_their_wait_in_its_prediction():
    """A request handed off to a worker that holds prompts is one more decode they would wait
    for: a short one keeps them waiting (the decodes there see their own steps), a long one
    lets them run in chunks beside it and the others."""
    pl = planner()
    p = trained("prefill-0", "prefill")
    d = _holding(left=20)
    d.add_prefill("queued", 800, prefill_pairs(800, 0), local=True, itl_slo_s=0.12)
    step = d.model.decode_step_s(41, 40 * 1000 + 1500)

    def handoff(max_tokens):
        cands = pl.candidates(shape(1500, seed=5, max_tokens=max_tokens), [p], [d])
        return next(c for c in cands if c.path is RoutePath.DISAGGREGATED)

    assert handoff(20).running_itl_s == pytest.approx(step)
    assert handoff(400).running_itl_s > 0.13
    assert d.model.decode_left == 20  # as it was


def test_a_prompt_queued_behind_a_colocated_one_prefills_beside_its_decode():
    """A prompt placed behind one that decodes where it prefills (colocated) runs its chunks
    beside that one's decode, sized to the step target, where one placed behind a prompt whose
    KV goes to a peer runs after it in whole-budget steps: both when the new prompt is to
    decode there too and when it prefills there for a peer."""
    pl = planner()
    w = trained("both-0", "both", seed=1, step_target_s=0.05)
    d = trained("decode-1", "decode", seed=2)
    m = w.model
    req = shape(512, seed=3)
    ahead, own = prefill_pairs(1024, 0), prefill_pairs(512, 0)

    def prefill_s() -> dict[str, float]:
        """The time until the prompt is computed on both-0: colocated, and for decode-1."""
        return {
            c.path.value: c.queue_s + c.prefill_s
            for c in pl.candidates(req, [w], [w, d])
            if w.worker_id in (c.prefill_worker, c.decode_worker)
        }

    w.add_prefill("for-a-peer", 1024, ahead, local=False)
    alone = m.chunked_s(1024 + 512, ahead + own, 0, 0)[0]
    paths = ("colocated", "disaggregated")
    assert prefill_s() == dict.fromkeys(paths, pytest.approx(alone))
    w.finish("for-a-peer")
    w.add_prefill("colocated", 1024, ahead, local=True, itl_slo_s=0.2)
    beside = m.chunked_s(1024, ahead, 0, 0)[0] + m.chunked_s(512, own, 1, 1024)[0]
    assert prefill_s() == dict.fromkeys(paths, pytest.approx(beside))
    assert beside > 1.2 * alone
    # A second colocated prompt, then one for a peer: the new prompt runs with the latter,
    # beside both decodes.
    two, peer = prefill_pairs(256, 0), prefill_pairs(128, 0)
    w.add_prefill("colocated-2", 256, two, local=True, itl_slo_s=0.2)
    w.add_prefill("for-a-peer-2", 128, peer, local=False)
    chain = (
        m.chunked_s(1024, ahead, 0, 0)[0]
        + m.chunked_s(256, two, 1, 1024)[0]
        + m.chunked_s(128 + 512, peer + own, 2, 1024 + 256)[0]
    )
    assert prefill_s() == dict.fromkeys(paths, pytest.approx(chain))


def test_prompts_held_for_the_decodes_running_wait_once_then_chunk_beside_those_to_come():
    """Where the worker holds prompts for its running decodes (they end within the hold), the
    prompts queued there wait them out once and then run without them; a colocated one among
    them decodes from its first token on, and the prompts after it chunk beside its decode: the
    hold is not counted again for it."""
    pl = planner()
    held = _holding(left=20)
    m = held.model
    wait = m.hold_wait_s(held.batch, held.context)
    assert wait is not None
    ahead, own = prefill_pairs(600, 0), prefill_pairs(400, 0)
    held.add_prefill("colocated", 600, ahead, local=True, itl_slo_s=0.2)
    c = pl.candidates(shape(400, seed=6), [], [held])[0]
    expect = wait + m.chunked_s(600, ahead, 0, 0)[0] + m.chunked_s(400, own, 1, 600, 0.0)[0]
    assert c.queue_s + c.prefill_s == pytest.approx(expect)
    assert m.chunked_s(400, own, 1, 600)[0] > m.chunked_s(400, own, 1, 600, 0.0)[0]


def test_a_prompt_behind_a_colocated_one_costs_its_decode_chunks_where_the_running_are_waited_for():
    """The running decodes end within the hold, so a prompt placed now waits for them; a
    colocated prompt queued ahead of it decodes from its first token on, for all its output,
    and the worker does not hold the new prompt for that decode: the new prompt's chunks run
    beside it. Its step is the chunk's, on both paths, and its misses are counted."""
    pl = planner()
    held = _holding(left=20)
    m = held.model
    assert m.hold_wait_s(held.batch, held.context) is not None
    held.add_prefill("colocated", 600, prefill_pairs(600, 0), local=True, itl_slo_s=0.13)
    own = prefill_pairs(400, 0)
    step = coming_chunk_step(held, 400, own)
    assert step == pytest.approx(m.chunked_s(400, own, 41, 40 * 1000 + 600, 0.0)[1])
    assert step >= 0.15 > m.decode_step_s(41, 40 * 1000 + 600)  # the floor measured there
    # Only the colocated request is at risk: the running ones end before the new prompt runs.
    req = shape(400, seed=6)
    for c in pl.candidates(req, [held], [held, trained("decode-1", "decode", seed=2)]):
        if held.worker_id in (c.prefill_worker, c.decode_worker):
            assert c.caused_misses > 0.5, (c.path, c.caused_misses)
